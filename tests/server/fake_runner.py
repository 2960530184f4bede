"""A tiny deterministic stand-in for runtime.ModelRunner (the engine's Runner protocol), for fast tests.

Tokens are ASCII characters (id = code point, vocabulary 128, id 0 = end of sequence). The "model"
predicts from the whole context, so a batched step gives each row exactly what it would get alone:
the next token is EOS after a "." and otherwise the letter 97 + (7 * sum(ids) + len(ids)) % 26.
``next_token`` is that definition, written once here for the tests to compare against.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from retopk_server.runtime.memory import MemoryUsage
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.session import Session
from retopk_server.runtime.stats import StepStats

VOCAB = 128
EOS = 0
LAYERS, HEADS = 2, 3


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


class FakeRunner:
    """step_delay_s: sleep per decode step (lets tests cancel mid-stream); gate: when given, every decode
    step waits until it is set (lets tests hold requests mid-stream). Records each decode batch size."""

    def __init__(self, max_context: int = 4096, step_delay_s: float = 0.0, gate: threading.Event | None = None) -> None:
        self.info = FakeInfo(max_context=max_context)
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

    def encode_chat(self, messages: list[dict]) -> list[int]:
        self._touch()
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"unknown role {m['role']!r}")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.tokenizer.encode(text)

    def decode_tokens(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def open_session(self, method: MethodSpec | None = None, session_id: str | None = None) -> Session:
        self._touch()
        method = method or self.info.default_method
        method.build()  # ValueError on a bad method, like the real runner
        session = Session(session_id or f"s{len(self.sessions)}", method, [0] * LAYERS, 64, 32)
        self.sessions[session.id] = session
        return session

    def memory(self) -> MemoryUsage:
        used = [s.nbytes() for s in self.sessions.values()]
        return MemoryUsage(kv_used=sum(u["kv"] for u in used), method_state_used=sum(u["method_state"] for u in used))

    def close_session(self, session: Session) -> None:
        self._touch()
        del self.sessions[session.id]
        session.closed = True

    def _logits(self, context: list[int]) -> torch.Tensor:
        logits = torch.zeros(VOCAB)
        logits[next_token(context)] = 10.0
        return logits

    def prefill(self, session: Session, token_ids: list[int]) -> torch.Tensor:
        self._touch()
        if session.length + len(token_ids) > self.info.max_context:
            raise ValueError(f"context too long: {session.length} + {len(token_ids)} > {self.info.max_context}")
        session.token_ids.extend(token_ids)
        session.blocks = list(range((session.length + 15) // 16))
        return self._logits(session.token_ids)

    def decode(self, sessions: list[Session], token_ids: list[int], with_stats: bool = False):
        self._touch()
        assert len(sessions) == len(token_ids) and len({s.id for s in sessions}) == len(sessions)
        self.batch_sizes.append(len(sessions))
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
            stats = [StepStats(path=torch.full((LAYERS, HEADS), 3, dtype=torch.int8),
                               max_sim=torch.full((LAYERS, HEADS), float("nan")),
                               n_scored=torch.full((LAYERS, HEADS), s.length, dtype=torch.int32),
                               attention_s=0.001, num_kv_heads=self.info.num_kv_heads) for s in sessions]
        return torch.stack(rows), stats
