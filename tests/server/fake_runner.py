"""A tiny deterministic stand-in for runtime.ModelRunner (the engine's Runner protocol), for fast tests.

Tokens are ASCII characters (id = code point, vocabulary 128, id 0 = end of sequence). The "model"
predicts from the whole context, so a batched step gives each row exactly what it would get alone:
the next token is EOS after a "." and otherwise the letter 97 + (7 * sum(ids) + len(ids)) % 26.
``next_token`` is that definition, written once here for the tests to compare against.

KV memory: a session holds one 64-byte "block" per BLOCK tokens. With ``kv_blocks`` the fake has a
cache budget of that many blocks and raises the runtime's BudgetExceeded past it, as the real runner does.
``log`` records ("prefill", tokens) per prefill chunk, ("prefill_together", jobs) per shared prefill and
("decode", batch) per decode step, in order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from retopk_server.runtime.budget import BudgetExceeded
from retopk_server.runtime.memory import MemoryUsage
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling_defaults import CHAT_DEFAULTS, CHAT_DEFAULTS_SOURCE
from retopk_server.runtime.session import Session
from retopk_server.runtime.session_state import SessionState, StateMismatch
from retopk_server.runtime.stats import StepStats, StepStatsBatch

VOCAB = 128
EOS = 0
LAYERS, HEADS = 2, 3
BLOCK, BLOCK_BYTES, STATE_BYTES = 16, 64, 32


def next_token(context: list[int]) -> int:
    if context and context[-1] == ord("."):
        return EOS
    return 97 + (7 * sum(context) + len(context)) % 26


def greedy_reference(context: list[int], n: int, stop_at_eos: bool = True) -> list[int]:
    """The tokens a greedy request generates after ``context`` (at most n)."""
    out, ctx = [], list(context)
    for _ in range(n):
        t = next_token(ctx)
        out.append(t)
        ctx.append(t)
        if stop_at_eos and t == EOS:
            break
    return out


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))

    def convert_ids_to_tokens(self, ids):
        return [chr(i) for i in ids]


@dataclass(frozen=True)
class FakeInfo:
    name: str = "fake"
    architecture: str = "FakeForCausalLM"
    num_layers: int = LAYERS
    num_heads: int = HEADS
    num_kv_heads: int = 1
    head_dim: int = 4
    max_context: int = 256
    vocab_size: int = VOCAB
    eos_token_ids: tuple[int, ...] = (EOS,)
    dtype: str = "float32"
    device: str = "cpu"
    backend: str = "torch"
    default_method: MethodSpec = field(default_factory=lambda: MethodSpec("retopk", (("top_k", 8),)))
    # the real runner's fallback (no generation config); top_p 0.9 keeps only the fake's one likely token
    sampling_defaults: tuple = CHAT_DEFAULTS
    sampling_source: str = CHAT_DEFAULTS_SOURCE
    weight_format: str = "float32, lm_head float32"
    weight_bytes: int = 1024
    kv_dtype: str = "float32"


class FakeRunner:
    """step_delay_s: sleep per decode step (lets tests cancel mid-stream); gate: when given, every decode
    step waits until it is set (lets tests hold requests mid-stream). Records each decode batch size."""

    def __init__(self, max_context: int = 4096, step_delay_s: float = 0.0, gate: threading.Event | None = None,
                 kv_blocks: int | None = None, prefill_delay_s: float = 0.0,
                 waits: Callable[[list[int], list[FakePrefill]], bool] | None = None) -> None:
        self.info = FakeInfo(max_context=max_context)
        self.waits = waits  # waits_for_prefix(session, token_ids, key, under_way) = waits(token_ids, under_way)
        self.kv_blocks = kv_blocks
        self.prefill_delay_s = prefill_delay_s
        self.trims = 0  # trim_pools calls (the engine's idle passes)
        self.log: list[tuple[str, int]] = []
        self._next_block = 0
        self.gate = gate
        self.tokenizer = FakeTokenizer()
        self.step_delay_s = step_delay_s
        self.sessions: dict[str, Session] = {}
        self.batch_sizes: list[int] = []
        self.threads: set[str] = set()  # names of the threads that called the runner

    def _touch(self) -> None:
        self.threads.add(threading.current_thread().name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._touch()
        return self.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        self._touch()
        for m in messages:
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"unknown role {m['role']!r}")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.tokenizer.encode(text)

    def decode_tokens(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def open_session(self, method: MethodSpec | None = None, session_id: str | None = None) -> Session:
        self._touch()
        method = method or self.info.default_method
        method.build()  # ValueError on a bad method, like the real runner
        session = Session(session_id or f"s{len(self.sessions)}", method, [0] * LAYERS, BLOCK_BYTES, STATE_BYTES)
        self.sessions[session.id] = session
        return session

    def fork(self, source: Session, count: int) -> list[Session]:
        """``count`` sessions holding ``source``'s tokens (the real runner shares its KV blocks; here each has
        its own, so a budget counts them)."""
        self._touch()
        forks = []
        for _ in range(count):
            fork = self.open_session(source.method, f"{source.id}-fork{len(self.sessions)}")
            fork.token_ids = list(source.token_ids)
            try:
                self.reserve(fork, source.length)
            except BudgetExceeded:
                for f in [*forks, fork]:
                    self.close_session(f)
                raise
            forks.append(fork)
        return forks

    def export_session(self, session: Session) -> SessionState:
        """The session's tokens; its "keys and values" are zeros of the fake's shape (LAYERS, 1, L, 4)."""
        self._touch()
        kv = torch.zeros((LAYERS, self.info.num_kv_heads, session.length, self.info.head_dim))
        return SessionState(session.method, torch.tensor(session.token_ids, dtype=torch.long), kv, kv.clone(), None)

    def check_import(self, state: SessionState) -> None:
        """StateMismatch for another KV shape, as the real runner (any thread)."""
        want = (LAYERS, self.info.num_kv_heads, state.length, self.info.head_dim)
        if tuple(state.k.shape) != want:
            raise StateMismatch(f"KV cache: k has shape {tuple(state.k.shape)}, this model's is {want}")
        if state.length and int(state.token_ids.max()) >= VOCAB:
            raise ValueError(f"token_ids: every id must lie in [0, {VOCAB})")

    def import_session(self, state: SessionState, session_id: str | None = None, checked: bool = False) -> Session:
        """A session holding ``state``'s tokens."""
        self._touch()
        if not checked:
            self.check_import(state)
        session = self.open_session(state.method, session_id)
        try:
            self.reserve(session, state.length)
        except BudgetExceeded:
            self.close_session(session)
            raise
        session.token_ids = state.token_ids.tolist()
        return session

    def make_room(self, sessions: list) -> None:
        """No pools to grow: a session's blocks are counted, not allocated."""
        self._touch()

    def rewind(self, session: Session, length: int) -> int:
        """The fake's model reads only the tokens: nothing to re-observe, so it keeps all ``length``."""
        self._touch()
        del session.token_ids[length:]
        del session.blocks[-(-length // BLOCK):]
        return length

    def memory(self) -> MemoryUsage:
        used = [s.nbytes() for s in self.sessions.values()]
        return MemoryUsage(kv_used=sum(u["kv"] for u in used), method_state_used=sum(u["method_state"] for u in used),
                           budget=(self.kv_blocks or 0) * BLOCK_BYTES)

    def used_blocks(self) -> int:
        return sum(len(s.blocks) for s in self.sessions.values())

    def close_session(self, session: Session) -> None:
        self._touch()
        del self.sessions[session.id]
        session.closed = True
        session.blocks = []

    def close_sessions(self, sessions: list[Session]) -> None:
        for session in sessions:
            self.close_session(session)

    def reserve(self, session: Session, length: int) -> None:
        self._touch()
        if length > self.info.max_context:
            raise ValueError(f"context too long: {length} > {self.info.max_context}")
        need = -(-length // BLOCK) - len(session.blocks)
        if need <= 0:
            return
        if self.kv_blocks is not None and self.used_blocks() + need > self.kv_blocks:
            free = self.kv_blocks - self.used_blocks()
            raise BudgetExceeded("the KV cache", need * BLOCK_BYTES, free * BLOCK_BYTES, self.kv_blocks * BLOCK_BYTES,
                                 session.id)
        session.blocks += list(range(self._next_block, self._next_block + need))
        self._next_block += need

    def start_prefill(self, session: Session, token_ids: list[int], prefix_key: bytes | None = None) -> FakePrefill:
        self._touch()  # no prefix cache: a fake prefill costs nothing
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        self.reserve(session, session.length + len(token_ids))
        return FakePrefill(self, session, list(token_ids))

    def waits_for_prefix(self, session: Session, token_ids: list[int], prefix_key: bytes | None,
                         under_way: list[FakePrefill]) -> bool:
        return self.waits is not None and self.waits(token_ids, under_way)  # the fake has no prefix cache

    def _logits(self, context: list[int]) -> torch.Tensor:
        logits = torch.zeros(VOCAB)
        logits[next_token(context)] = 10.0
        return logits

    def prefill(self, session: Session, token_ids: list[int]) -> torch.Tensor:
        job = self.start_prefill(session, token_ids)
        return job.step(job.remaining)

    def prefill_together(self, plan: list[tuple[FakePrefill, int]]) -> list[torch.Tensor | BaseException | None]:
        """Each job's ``step`` in turn (a job that raises stops alone), logged as ("prefill_together", jobs)."""
        self.log.append(("prefill_together", len(plan)))
        out = []
        for job, n in plan:
            try:
                out.append(job.step(n))
            except Exception as e:  # noqa: BLE001 - as the runtime's: this job alone
                out.append(e)
        return out

    def trim_pools(self) -> int:
        self._touch()
        self.trims += 1
        return 0  # the fake keeps nothing for later

    def decode(self, sessions: list[Session], token_ids: list[int], with_stats: bool = False):
        self._touch()
        assert len(sessions) == len(token_ids) and len({s.id for s in sessions}) == len(sessions)
        self.batch_sizes.append(len(sessions))
        self.log.append(("decode", len(sessions)))
        for s in sessions:
            self.reserve(s, s.length + 1)
        if self.gate is not None:
            self.gate.wait()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        rows = []
        for s, t in zip(sessions, token_ids, strict=True):
            assert not s.closed and s.length < self.info.max_context
            s.token_ids.append(t)
            rows.append(self._logits(s.token_ids))
        stats = None
        if with_stats:
            stats = StepStatsBatch.of_rows([StepStats(path=torch.full((LAYERS, HEADS), 3, dtype=torch.int8),
                                                      max_sim=torch.full((LAYERS, HEADS), float("nan")),
                                                      n_scored=torch.full((LAYERS, HEADS), s.length, dtype=torch.int32),
                                                      attention_s=0.001, num_kv_heads=self.info.num_kv_heads)
                                            for s in sessions])
        return torch.stack(rows), stats


class FakePrefill:
    """The fake's PrefillJob: feeds the tokens ``step`` by ``step`` (each sleeping ``prefill_delay_s``)."""

    def __init__(self, runner: FakeRunner, session: Session, token_ids: list[int]) -> None:
        self.runner, self.session, self.token_ids = runner, session, token_ids
        self.begin = self.pos = session.length
        self.end = self.begin + len(token_ids)
        self.cached = self.looked_up = 0

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def step(self, max_tokens: int) -> torch.Tensor | None:
        self.runner._touch()
        n = min(max(1, max_tokens), self.remaining)
        self.runner.log.append(("prefill", n))
        if self.runner.prefill_delay_s:
            time.sleep(self.runner.prefill_delay_s)
        self.session.token_ids.extend(self.token_ids[self.pos - self.begin:self.pos - self.begin + n])
        self.pos += n
        return self.runner._logits(self.session.token_ids) if self.pos == self.end else None

    def abort(self) -> None:
        del self.session.token_ids[self.begin:]
        keep = -(-self.begin // BLOCK)
        if not self.session.closed:
            del self.session.blocks[keep:]
