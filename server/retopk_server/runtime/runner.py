"""ModelRunner: a Llama-family decoder (runtime/decoder) whose attention runs through the ReTopK core, with sessions.

Prefill is dense and chunked (``start_prefill`` hands out a PrefillJob a scheduler advances chunk by chunk;
``prefill_together`` runs several sessions' chunks in one forward, prefill.py); decoding advances any set of
open sessions by one token in a single forward, each row with its own length and its session's method. The
KV pool and the method-state pools share one CacheBudget (budget.py, ``RuntimeConfig.kv_cache_bytes``): an
allocation it cannot hold raises BudgetExceeded with nothing changed. One forward (``forward``) is
decoder.llama.forward with the runtime's attention (attention.py's ``attend``: each layer's new keys and
values into the KV pool, then dense prefill or the rows' methods).
"""

from __future__ import annotations

import logging
import math
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from retopk_server.runtime import session_state
from retopk_server.runtime.attention import DecodeContext, DecodeGroup, MethodGroup, PrefillContext, StepKV
from retopk_server.runtime.budget import BudgetExceeded, CacheBudget, default_cache_bytes
from retopk_server.runtime.chat_tools import template_messages
from retopk_server.runtime.decoder.llama import Layers, forward
from retopk_server.runtime.kv_pool import KVPool
from retopk_server.runtime.loading import from_model, load
from retopk_server.runtime.memory import MemoryUsage, release_freed_memory
from retopk_server.runtime.method_limits import method_state_bytes
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.prefill import PrefillJob, step_together
from retopk_server.runtime.prefix_cache import PrefixCache, block_hashes, shared_run
from retopk_server.runtime.runtime_config import RuntimeConfig
from retopk_server.runtime.sampling_defaults import model_defaults
from retopk_server.runtime.session import Session
from retopk_server.runtime.session_state import SessionState
from retopk_server.runtime.stats import StepStatsBatch
from retopk_server.runtime.vocab import first_bad_token, not_a_token
from retopk_server.runtime.whole_step import whole_step

log = logging.getLogger("retopk_server.runtime")


class ContextTooLong(ValueError):
    """The session would exceed the runner's max_context (the model's trained positions unless RoPE-scaled)."""


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str  # of activations: the residual stream and every matmul's result
    device: str
    backend: str
    default_method: MethodSpec
    # what an unset sampling field of a request takes, and where that comes from (sampling_defaults.py)
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    sampling_source: str = ""
    weight_format: str = ""  # the matmuls' weight formats, e.g. "int4, lm_head int8" (decoder/linear.py)
    weight_bytes: int = 0  # weight bytes one decode step reads
    kv_dtype: str = ""


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class ModelRunner:
    """Owns the model, the KV block pool, the method states and the open sessions. One thread only."""

    def __init__(self, config: RuntimeConfig, model=None, tokenizer=None) -> None:
        """``model``: an already loaded transformers causal LM to serve instead of ``config.model`` (its
        weights are copied into the decoder in ``config.weights``; "as-stored" keeps its dtype)."""
        self.config = config
        self.device = torch.device(config.device)
        # a decode step's layers in one call where the step allows it (whole_step.py); False: always layer by
        # layer, the baseline of the tests and benchmarks that compare the two
        self.layers_in_one_call = True
        fmt = config.weight_format()
        if model is None:
            loaded = load(config.model, fmt, config.rope_scaling)
        else:
            loaded = from_model(model, fmt, config.rope_scaling)
            loaded.tokenizer = tokenizer
        self.decoder = loaded.decoder.to(self.device)
        activations = config.activations
        if activations == "auto":  # resolved once, here: ModelInfo's weight_format shows what it became
            activations, why = self.decoder.auto_activations()
            log.info("activations auto: %s (%s)", activations, why)
        self.decoder.set_activations(activations)
        if config.kv_torch_dtype == torch.float32:  # the exact configuration: no 16-bit product anywhere
            self.decoder.set_prefill_dtype(torch.float32)
        self.decoder.hold_wide()  # only the prefill copies the rule multiplies through (decoder/linear.py)
        log.info("prefill copies of the block weights: %.1f MB held", self.decoder.wide_bytes / 1e6)
        self.tokenizer = loaded.tokenizer
        cfg = loaded.config
        trained = int(cfg.max_position_embeddings)
        if config.rope_scaling is not None:
            trained = int(trained * float(config.rope_scaling["factor"]))
        window = getattr(cfg, "sliding_window", None)
        if window is not None:
            # sliding-window attention is not implemented by the core: stay within the window, where it is exact
            trained = min(trained, int(window))
        if config.max_context is not None and config.max_context > trained:
            raise ValueError(f"max_context {config.max_context} exceeds the model's {trained} positions; "
                             "set rope_scaling to extend the context")
        self.max_context = config.max_context or trained

        num_layers, num_heads = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        self._shape = (num_layers, num_heads, num_kv_heads, head_dim)
        generation = loaded.generation_config
        eos = _ids(getattr(generation, "eos_token_id", None))
        eos += _ids(getattr(cfg, "eos_token_id", None))
        if self.tokenizer is not None:
            eos += _ids(self.tokenizer.eos_token_id)
        sampling, sampling_source = model_defaults(generation)
        kv_dtype = config.kv_torch_dtype
        self.info = ModelInfo(
            name=config.model, architecture=loaded.architecture, num_layers=num_layers, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim, max_context=self.max_context,
            vocab_size=int(cfg.vocab_size), eos_token_ids=tuple(dict.fromkeys(eos)), dtype="float32",
            device=str(self.device), backend=config.method_backend(config.default_method.name),
            default_method=config.default_method, sampling_defaults=sampling, sampling_source=sampling_source,
            weight_format=self.decoder.weight_format, weight_bytes=self.decoder.weight_bytes,
            kv_dtype=str(kv_dtype).removeprefix("torch."))
        limit = config.kv_cache_bytes or default_cache_bytes(self.device, config.kv_cache_fraction)
        self.budget = CacheBudget(limit)
        self.pool = KVPool(num_layers, num_kv_heads, head_dim, config.kv_block_size, kv_dtype, self.device,
                           budget=self.budget)
        self.prefix_cache = PrefixCache(self.pool) if config.prefix_cache else None
        self._groups: dict[MethodSpec, MethodGroup] = {}
        self.sessions: dict[str, Session] = {}
        self._group(config.default_method)  # a bad default method fails here, not on the first request

    # ---- text --------------------------------------------------------------------------------------
    def _tok(self):
        if self.tokenizer is None:
            raise RuntimeError("this runner has no tokenizer")
        return self.tokenizer

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation in the model's chat template, ending with the assistant prompt;
        ``tools``, assistant ``tool_calls`` and "tool" messages as chat_tools.py renders them."""
        messages, extra = template_messages(self._tok(), messages, tools)
        out = self._tok().apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return [int(t) for t in out]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [int(t) for t in self._tok().encode(text, add_special_tokens=add_special_tokens)]

    def decode_tokens(self, ids) -> str:
        return self._tok().decode(list(ids), skip_special_tokens=True)

    # ---- sessions ----------------------------------------------------------------------------------
    def _group(self, spec: MethodSpec) -> MethodGroup:
        """The method-state pools of ``spec``, made on first use; one per distinct spec, dropped again when
        its last session closes (but the default method's). BudgetExceeded when its first slot would not fit."""
        group = self._groups.get(spec)
        if group is None:
            backend = self.config.method_backend(spec.name)
            num_layers, num_heads, num_kv_heads, head_dim = self._shape
            self.budget.check(self._state_bytes(spec, backend), "the method state")
            group = MethodGroup(spec.build(backend=backend), num_layers, num_heads, num_kv_heads, head_dim,
                                self.device, budget=self.budget)
            self._groups[spec] = group
        return group

    def _state_bytes(self, spec: MethodSpec, backend: str) -> int:
        """One session's state of ``spec`` over all layers (method_limits.py, on a throwaway method object: its
        init_state counts layers); 0 for a method that cannot be measured so, whose growth the budget checks."""
        try:
            return method_state_bytes(spec.build(backend=backend), self.info)
        except Exception:  # noqa: BLE001 - a method whose init_state computes on the device
            return 0

    def _drop_if_unused(self, spec: MethodSpec) -> bool:
        group = self._groups.get(spec)
        if group is not None and group.used_slots == 0 and spec != self.config.default_method:
            del self._groups[spec]
            group.close()
            return True
        return False

    def open_session(self, method: MethodSpec | None = None, session_id: str | None = None) -> Session:
        """A new empty session; ValueError for a bad method or id, BudgetExceeded when its method's pools cannot
        be made. Its method state is allocated when it first needs it (``_ensure_slots``, at its first prefill),
        so an empty session holds no memory."""
        spec = method or self.config.default_method
        if not isinstance(spec, MethodSpec):
            raise ValueError(f"method must be a MethodSpec, got {spec!r}")
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise ValueError(f"session id {session_id!r} is already open")
        try:
            group = self._group(spec)  # a bad method fails here, at the session's creation
        except BudgetExceeded as e:
            e.method = spec
            raise
        session = Session(session_id, spec, None, self.pool.block_nbytes, group.slot_nbytes())
        self.sessions[session_id] = session
        return session

    def _ensure_slots(self, session: Session, fresh: bool = True) -> None:
        """The session's method-state slots, allocated on its first need; BudgetExceeded (after the KV pool gave
        back its unused tail) when they do not fit. ``fresh=False``: not reset, the caller writes a whole state
        into them (an import: resetting first would write the state's bytes twice)."""
        if session.slots is not None:
            return
        try:
            session.slots = self._alloc_slots(session.method, session.id, fresh)
        except BudgetExceeded:
            if self.prefix_cache is not None:
                self.prefix_cache.evict()  # its idle blocks go before the pool is compacted and trimmed
            self._compact()
            released = self.trim_pools(pressure=True)
            if not self.pool.trim(pressure=True) and not released:
                raise
            session.slots = self._alloc_slots(session.method, session.id, fresh)

    def trim_pools(self, pressure: bool = False) -> int:
        """Give back the method-state slots the pools keep for a load that may come back (MethodGroup.shrink's hold):
        once their hold has passed (the engine calls this when idle; room ``make_room`` made for sessions about
        to come stays), or at once under memory pressure (``pressure``) -> bytes freed."""
        groups = [g for g in self._groups.values() if pressure or g.deferred]
        freed = sum(group.shrink(hold=not pressure) for group in groups)
        if freed:
            release_freed_memory()
        return freed

    def _compact(self) -> None:
        """Move the KV pool's used blocks to its lowest ids (KVPool.compact) and rename them in every holder: the
        open sessions and the prefix cache. Then the pool can give back all its free blocks (``trim``), not
        only a free tail: freed cached blocks and closed sessions' blocks between live ones stop pinning the
        budget. PrefillJobs read their session's blocks at each step, so a job in progress follows."""
        moved = self.pool.compact()
        if not moved:
            return
        for session in self.sessions.values():
            session.blocks = [moved.get(b, b) for b in session.blocks]
        if self.prefix_cache is not None:
            self.prefix_cache.rename(moved)

    def _alloc_slots(self, spec: MethodSpec, session_id: str, fresh: bool = True) -> list[int]:
        try:
            return self._group(spec).alloc(session_id, fresh)
        except BudgetExceeded as e:
            e.method = spec
            self._drop_if_unused(spec)
            raise

    def close_session(self, session: Session) -> None:
        """Free the session's KV blocks and method-state slots (idempotent); pools that are mostly free after
        that give their memory back (KVPool.shrink, MethodGroup.shrink), so that an idle server's footprint
        returns near its idle figure."""
        self.close_sessions([session])

    def close_sessions(self, sessions: list[Session]) -> None:
        """``close_session`` of each, the pools' upkeep once after the last: a decode step whose rows all end
        closes them together, and closing one by one compacted the KV pool as the used blocks fell below a
        quarter (moving the blocks of sessions about to close) and resized the pools on the way down. The
        pools end sized by their rules for what is left open, as after the last of the one-by-one closes."""
        closing = [s for s in sessions if not s.closed]
        if not closing:
            return
        groups = {}
        for session in closing:
            self.pool.release(session.blocks)
            group = self._groups.get(session.method)
            if session.slots is not None and group is not None:
                group.free(session.slots)
                groups[session.method] = group
            session.blocks, session.slots, session.closed = [], None, True
            self.sessions.pop(session.id, None)
        freed = sum(group.shrink() for group in groups.values())
        if self.prefix_cache is not None and self.config.prefix_cache_bytes is not None:
            self.prefix_cache.evict_to(self.config.prefix_cache_bytes)  # the blocks it held may be idle now
        if 4 * self.pool.used_blocks <= self.pool.capacity:  # shrink's condition, wherever the used blocks lie
            self._compact()
        freed += sum(self._drop_if_unused(spec) for spec in dict.fromkeys(s.method for s in closing))
        freed += self.pool.shrink()
        if freed:
            release_freed_memory()

    def _check_open(self, session: Session) -> None:
        if session.closed or self.sessions.get(session.id) is not session:
            raise ValueError(f"session {session.id!r} is not open on this runner")

    def reserve(self, session: Session, length: int) -> None:
        """KV blocks for ``length`` positions in the session: ContextTooLong past max_context, BudgetExceeded
        (nothing allocated) when the cache budget cannot hold them."""
        if length > self.max_context:
            raise ContextTooLong(f"session {session.id!r}: {length} tokens exceed max_context {self.max_context}")
        need = self.pool.blocks_for(length) - len(session.blocks)
        session.blocks.extend(self._alloc_blocks(need, session.blocks[-1] if session.blocks else None, session.id))

    def _alloc_blocks(self, n: int, after: int | None, session_id: str) -> list[int]:
        """``n`` blocks from the pool; when the budget refuses, idle cached prefix blocks go before anything else,
        then the method-state slots the pools hold unused (the engine evicts idle sessions after)."""
        try:
            return self.pool.alloc(n, after=after, session_id=session_id)
        except BudgetExceeded:
            evicted = self.prefix_cache is not None and self.prefix_cache.evict(n - self.pool.free_blocks)
            if not evicted and not self.trim_pools(pressure=True):
                raise
            return self.pool.alloc(n, after=after, session_id=session_id)

    def fork_prefix(self, source: Session, targets: list[Session], length: int) -> None:
        """Give each empty target session the source's first ``length`` tokens, their keys and values copied.

        Nothing is computed, and the targets' methods observe none of these tokens: prefill the rest of
        a prompt into each target afterwards (at least its method's ``prefill_queries`` tokens, so that
        its prefill sees the prompt's last queries). The evaluation computes a long prompt's dense
        prefix once this way for many methods' sessions.
        """
        self._check_open(source)
        if not 0 < length <= source.length:
            raise ValueError(f"length must lie in [1, {source.length}] (the source's tokens), got {length}")
        n = self.pool.blocks_for(length)
        for target in targets:
            self._check_open(target)
            if target.length or target is source:
                raise ValueError(f"session {target.id!r} must be empty to receive a prefix")
            self.reserve(target, length)
            self.pool.copy(source.blocks[:n], target.blocks[:n])
            target.token_ids.extend(source.token_ids[:length])

    def fork(self, source: Session, count: int) -> list[Session]:
        """``count`` new sessions that each continue exactly where ``source`` stands (n > 1 from one prefill).

        Nothing is computed: the full KV blocks are shared copy-on-write (KVPool reference counts; no
        session ever writes a position it already holds, so sharing is safe until each is released), the
        partly filled last block is copied, and the method state (ReTopK's query-support FIFOs, a baseline's
        state) is copied slot by slot. All or nothing: BudgetExceeded with no session opened when the copies
        do not fit.
        """
        self._check_open(source)
        group = self._groups[source.method]
        forks: list[Session] = []
        try:
            for _ in range(count):
                fork = self.open_session(source.method)
                full = source.length // self.pool.block_size
                fork.blocks = self.pool.share(source.blocks[:full])
                fork.token_ids = list(source.token_ids)
                forks.append(fork)
                self.reserve(fork, source.length)  # the partial last block, fresh
                if len(fork.blocks) > full:
                    self.pool.copy(source.blocks[full:full + 1], fork.blocks[full:full + 1])
                if source.slots is not None:  # a method state exists once the source was prefilled
                    self._ensure_slots(fork)
                    group.copy_state(source.slots, fork.slots)
        except BaseException:
            for fork in forks:
                self.close_session(fork)
            raise
        return forks

    def export_session(self, session: Session) -> SessionState:
        """A copy of the session's tokens, keys, values and method state (runtime/session_state.py)."""
        self._check_open(session)
        return session_state.capture(self.pool, self._groups.get(session.method), session)

    def check_import(self, state: SessionState) -> None:
        """StateMismatch (what differs) or ValueError (a value out of bounds) when ``state`` cannot be imported
        here. Reads only what the runner fixed at its start: any thread may call it (the bounds of a large
        state are checked off the engine thread)."""
        session_state.check(state, self.pool, self.info.vocab_size, self.max_context)

    def import_session(self, state: SessionState, session_id: str | None = None, checked: bool = False) -> Session:
        """A new session holding ``state`` (another runner's ``export_session``), which continues exactly as the
        exported one would. ``check_import``'s errors before anything is allocated (``checked``: it passed
        already); BudgetExceeded with nothing kept when it does not fit."""
        if not checked:
            self.check_import(state)
        session = self.open_session(state.method, session_id)
        try:
            if state.state is not None:
                self._ensure_slots(session, fresh=False)  # restore writes every field (write_state checks so)
            self.reserve(session, state.length)
            session_state.restore(self.pool, self._groups[state.method], session, state)
        except BaseException:
            self.close_session(session)
            raise
        return session

    def make_room(self, sessions: list[tuple[int, MethodSpec | None]]) -> None:
        """Room for sessions about to be imported, (tokens, the method whose state comes with them or None) each:
        the KV pool and each method's pools grown once to hold them all, as far as the budget allows without
        evicting anything (a restart's saved sessions: else their imports double the pools one after another,
        each doubling a copy of everything before it, in some session's first turn). The room stays while the
        sessions come, though some close meanwhile (KVPool.make_free; the method pools' hold), until memory is
        short. Each session gets one block more than its tokens fill: it comes back to continue, and a turn that
        crosses into a new block with no block free would grow the pool in that turn (where it grows by copying, a
        copy of every block). A method this runner cannot build is skipped (that session's import says why)."""
        self.pool.make_free(sum(self.pool.blocks_for(length) + 1 for length, _ in sessions))
        for spec, count in Counter(spec for _, spec in sessions if spec is not None).items():
            try:
                group = self._group(spec)
            except (BudgetExceeded, ValueError):
                continue
            group.make_free(count)

    def rewind(self, session: Session, length: int) -> int:
        """Keep at most the session's first ``length`` tokens, its method state reset to a fresh session's ->
        how many it kept: ``length`` less the method's ``prefill_queries``, so that the next prefill, which
        re-feeds them, lets the method observe the last queries of the conversation as a fresh session's
        prefill of the same tokens would (engine/turn.py rewinds an edited chat history so)."""
        self._check_open(session)
        if not 0 <= length <= session.length:
            raise ValueError(f"length must lie in [0, {session.length}], got {length}")
        kept = length
        if session.slots is not None:
            kept = max(0, length - self.prefill_queries(session))
            self._groups[session.method].reset(session.slots)
        session_state.truncate(self.pool, session, kept)
        self._own_last_block(session)
        return kept

    def _own_last_block(self, session: Session) -> None:
        """Copy on write: the session's partly kept last block becomes its own copy when others hold it too (the
        prefix cache, another session mapping the same cached prefix), since the session will write into it."""
        if session.length % self.pool.block_size and self.pool.holders(session.blocks[-1]) > 1:
            [fresh] = self._alloc_blocks(1, None, session.id)
            self.pool.copy(session.blocks[-1:], [fresh])
            self.pool.release(session.blocks[-1:])
            session.blocks[-1] = fresh

    def prefill_queries(self, session: Session) -> int:
        """How many of a prompt's last queries the session's method observes at prefill (ReTopK: C)."""
        return self._group(session.method).method.prefill_queries

    def memory(self) -> MemoryUsage:
        """Cache bytes in use (counted by the pools: blocks and slots handed out), reserved by the KV pool
        and the method-state pools, and the budget they share."""
        groups, cache, block = self._groups.values(), self.prefix_cache, self.pool.block_nbytes
        cached, idle = (len(cache), cache.idle_blocks) if cache is not None else (0, 0)
        return MemoryUsage(kv_used=(self.pool.used_blocks - idle) * block, kv_reserved=self.pool.nbytes(),
                           method_state_used=sum(g.used_slots * g.slot_nbytes() for g in groups),
                           method_state_reserved=sum(g.reserved for g in groups), budget=self.budget.limit,
                           prefix_cache_blocks=cached, prefix_cache_bytes=cached * block,
                           prefix_cache_idle_bytes=idle * block)

    # ---- steps -------------------------------------------------------------------------------------
    def method_group(self, spec: MethodSpec) -> MethodGroup:
        """The group that runs ``spec``'s sessions: its method and one state pool a layer (exists while a session
        of ``spec`` is open)."""
        return self._groups[spec]

    def forward(self, ctx: PrefillContext | DecodeContext, input_ids: torch.Tensor,
                position_ids: torch.Tensor, layers: Layers | None = None,
                logits_at: list[int] | None = None, top_position: int | None = None) -> torch.Tensor | None:
        """One forward of the decoder whose attention runs from ``ctx`` (prefill chunks or a decode step):
        input_ids, position_ids (B, T) -> float32 logits (B, V) after each row's last token, or at the tokens
        ``logits_at`` (decoder.llama.forward). ``layers``: the step's layers in one call (whole_step.py), else
        layer by layer. ``top_position``: a decode step's max(position_ids), from the sessions' lengths."""
        return forward(self.decoder, input_ids, position_ids, ctx.attend, layers, logits_at, top_position)

    def start_prefill(self, session: Session, token_ids: list[int], prefix_key: bytes | None = None) -> PrefillJob:
        """Check token_ids and reserve the session's blocks for them -> a PrefillJob to run (prefill.py).

        prefix_key: the namespace of the prefix cache (prefix_cache.namespace: the caller's key and salt) for
        the session's first prefill: the prompt's cached blocks are mapped into the session and only the rest
        is prefilled (``job.cached`` says how many tokens came from the cache), and its full blocks are cached
        once it is in. None, a later turn, or a runner without a prefix cache: neither.
        ContextTooLong past max_context or BudgetExceeded, before anything changes; AssertionError for an empty
        list or an id outside the vocabulary (the caller's bug).
        """
        self._check_open(session)
        token_ids = [int(t) for t in token_ids]
        # Invariants, not a client's refusal (service/wire.py refuses bad ids naming the field). Raised, not
        # asserted, so that python -O keeps them: the embedding lookup is torch indexing, which would take a
        # negative id silently from the table's end.
        if not token_ids:
            raise AssertionError("token_ids must not be empty")
        if (i := first_bad_token(token_ids, self.info.vocab_size)) is not None:
            raise AssertionError(f"token_ids[{i}]: {not_a_token(token_ids, i, self.info.vocab_size)}")
        begin, tail = session.length, None
        hashes = self._prefix_hashes(session, token_ids, prefix_key)
        if hashes is not None:
            # mapped first: held by the session, these blocks are safe from the evictions that room may need
            session.blocks, tail = self._map_cached(session, hashes, len(token_ids))
            session.token_ids = token_ids[:len(session.blocks) * self.pool.block_size]
        try:
            self._ensure_slots(session)
            self.reserve(session, begin + len(token_ids))
        except BaseException:
            if hashes is not None:  # the session gives its mapped blocks back: nothing changed
                self.pool.release(session.blocks)
                session.blocks, session.token_ids = [], []
            raise
        return PrefillJob(self, session, token_ids, begin, hashes, tail)

    def _prefix_hashes(self, session: Session, token_ids: list[int], prefix_key: bytes | None) -> list[bytes] | None:
        """The chain hashes the prefix cache looks a prompt's full blocks up by and caches them under
        (prefix_cache.py), or None when it does neither: a later turn, no namespace, no cache."""
        if prefix_key is None or self.prefix_cache is None or session.length:
            return None
        return block_hashes(prefix_key, token_ids, self.pool.block_size)

    def waits_for_prefix(self, session: Session, token_ids: list[int], prefix_key: bytes | None,
                         under_way: list[PrefillJob]) -> bool:
        """Whether the first prompt ``token_ids`` of ``session`` would take more of its start from the prefix cache
        after the prefills ``under_way`` (started, not yet in) have cached theirs: one of them shares more of the
        blocks a hit may cover (``cached_prefix``, in whole grids; the same chain hashes, so the same namespace
        and tokens) than the cache holds now. The engine then starts it once they are in, not beside them
        (engine/admission.py). Nothing changes."""
        hashes = self._prefix_hashes(session, token_ids, prefix_key)
        if not hashes:
            return False
        P, grid = self.pool.block_size, self.prefill_grid // self.pool.block_size
        hashes = hashes[:self.cached_prefix(session, len(token_ids), with_queries=True) // P]
        now = self.prefix_cache.cached_run(hashes, grid)
        return any(job.hashes is not None and shared_run(hashes, job.hashes) // grid * grid > now
                   for job in under_way)

    def _map_cached(self, session: Session, hashes: list[bytes], length: int) -> tuple[list[int], torch.Tensor | None]:
        """The cached blocks a ``length``-token first prompt of ``session`` starts with, held for it, and the tail
        queries the method needs from them (``cached_prefix``; None when it needs none)."""
        cache, P, Q = self.prefix_cache, self.pool.block_size, self.prefill_queries(session)
        blocks = cache.lookup(hashes, self.cached_prefix(session, length, with_queries=True) // P,
                              self.prefill_grid // P)
        hit = len(blocks) * P
        if length - hit >= Q:  # the prefill computes every query the method observes
            return blocks, None
        tail = cache.queries(hashes[hit // P - 1]) if hit else None
        if tail is not None and tail.shape[2] >= Q - (length - hit):
            return blocks, tail
        keep = self.cached_prefix(session, length) // P  # without them: the last Q tokens are prefilled
        self.pool.release(blocks[keep:])
        return blocks[:keep], None

    def cached_prefix(self, session: Session, length: int, with_queries: bool = False) -> int:
        """The most tokens of a ``length``-token first prompt of ``session`` that may come from the prefix cache:
        a multiple of the prefill grid (``prefill_grid``), so that the rest is prefilled in the same chunks as
        the whole prompt would be, that leaves at least the prompt's last token to prefill (its logits are the
        prefill's result) and, unless the cache keeps the tail queries at that boundary (``with_queries``,
        prefix_cache.py), the last ``prefill_queries`` tokens too: the method observes their queries (ReTopK
        seeds its FIFO from them)."""
        keep = 1 if with_queries else max(1, self.prefill_queries(session))
        return max(0, length - keep) // self.prefill_grid * self.prefill_grid

    @property
    def prefill_grid(self) -> int:
        """lcm(kv_block_size, prefill_chunk): a cache hit covers a multiple of it (``cached_prefix``)."""
        return math.lcm(self.pool.block_size, self.config.prefill_chunk)

    def prefill(self, session: Session, token_ids: list[int], prefix_key: bytes | None = None) -> torch.Tensor:
        """Append token_ids to the session (dense, chunked) -> (vocab,) float32 logits after the last one.

        Works for a first prompt and for a later turn's new tokens alike; ``prefix_key`` as in start_prefill.
        Raises ContextTooLong (nothing is done) if the session would exceed max_context, BudgetExceeded if its
        blocks do not fit.
        """
        job = self.start_prefill(session, token_ids, prefix_key)
        return job.step(job.remaining)

    def prefill_together(self, plan: list[tuple[PrefillJob, int]]) -> list[torch.Tensor | BaseException | None]:
        """Feed each (job, n) of ``plan`` up to n more tokens, the jobs' chunks in shared forwards (prefill.py's
        ``step_together``: each job gets what its own ``step(n)`` gives) -> per job its (vocab,) logits once its
        prompt is in, else None, or the exception that stopped it (abort that job)."""
        return step_together(self, plan)

    @torch.inference_mode()
    def decode(self, sessions: list[Session], token_ids: list[int], with_stats: bool = False,
               ) -> tuple[torch.Tensor, StepStatsBatch | None]:
        """Feed one token to each session in one forward -> (logits (B, vocab) float32, stats or None; ``stats[i]``
        is row i's StepStats)."""
        if len(sessions) != len(token_ids) or not sessions:
            raise ValueError("sessions and token_ids must be non-empty and of equal length")
        if len({s.id for s in sessions}) != len(sessions):
            raise ValueError("a session appears twice in one decode step")
        for s in sessions:
            self._check_open(s)
        for s in sessions:
            if s.length + 1 > self.max_context:
                raise ContextTooLong(f"session {s.id!r}: {s.length + 1} tokens exceed max_context {self.max_context}")
        for s in sessions:
            self._ensure_slots(s)
            self.reserve(s, s.length + 1)
        dev = self.device
        positions = [s.length for s in sessions]
        start = torch.tensor(positions, dtype=torch.long, device=dev)  # (B,)
        by_spec: dict[MethodSpec, list[int]] = {}
        for row, s in enumerate(sessions):
            by_spec.setdefault(s.method, []).append(row)
        groups = []
        for spec, rows in by_spec.items():
            # layer l's row: each session's slot in it, flat (one list of ints makes a tensor faster than tuples)
            per_layer = [slot for layer in zip(*(sessions[r].slots for r in rows), strict=True) for slot in layer]
            slots = torch.tensor(per_layer, dtype=torch.long, device=dev).view(-1, len(rows))  # (layers, n)
            row_t = None if len(by_spec) == 1 else torch.tensor(rows, dtype=torch.long, device=dev)
            groups.append(DecodeGroup(self._groups[spec], row_t, slots))
        blocks = [s.blocks for s in sessions]
        kv = StepKV(self.pool, self.pool.block_table(blocks, dev), start, start + 1,
                    self.pool.step_rows(blocks, positions, dev))
        ctx = DecodeContext(kv, groups, with_stats)
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev).view(-1, 1)  # (B, 1)
        layers = whole_step(self.decoder, ctx, [p + 1 for p in positions]) if self.layers_in_one_call else None
        logits = self.forward(ctx, ids, start.view(-1, 1), layers, top_position=max(positions))
        for s, t in zip(sessions, token_ids, strict=True):
            s.token_ids.append(int(t))
        return logits, (self._collect_stats(ctx, by_spec, len(sessions)) if with_stats else None)

    def _collect_stats(self, ctx: DecodeContext, by_spec: dict, batch: int) -> StepStatsBatch:
        """The step's statistics, each method group's per-layer (n, H) tensors stacked once into the batch's."""
        groups = [(rows, ctx.stats[gi], ctx.attention_s[gi]) for gi, rows in enumerate(by_spec.values())]
        return StepStatsBatch.of_groups(batch, groups, self.info.num_kv_heads)
