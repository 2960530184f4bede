"""The decoder's attention in the runtime: a prefill context and a decode context, each with its ``attend``.

The decoder (decoder/llama.py) computes each layer's q, k, v and RoPE and calls ``ctx.attend(layer, q, k,
v, scale)``: the new keys and values go into the rows' KV blocks (StepKV, shared by both contexts), then the
layer's attention runs over the pool with each row's length.

Prefill (one chunk of each of S sessions, ragged along the forward's token axis: session i's T_i tokens at
its positions s_i .. s_i + T_i - 1): dense softmax attention per session, causal within its chunk and full to
its earlier positions, via SDPA with GQA; sessions never see each other. The method sees a prompt's last
``prefill_queries`` queries (``method.prefill``) once the forward of its last chunk has finished
(``PrefillSegment.observe``), so that a forward that fails has changed no method state.
Decode (B sessions, one token each): rows are grouped by method, each group calls ``method.decode``
on a PagedKV view of its rows, outputs are scattered back into the batch.

Nothing here reads the device back between the first and the last layer of a decode step. With
statistics on, the attention core is timed by CUDA events recorded around each method group (on a
CPU device: wall time), each layer's (path, max_sim, n_scored) stays on the device, and after the last
layer all of them travel to the host in one packed copy, which also completes the events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from retopk_core.cpu import decoder_ops
from retopk_core.methods.base import AttentionMethod, SlotPool
from retopk_server.runtime.budget import BudgetExceeded, CacheBudget
from retopk_server.runtime.kv_pool import OUT_OF_MEMORY, KVPool, allocation_failed

# Largest prefill score matrix (heads x query rows x keys) materialised at once, in elements (256 MiB in fp32).
PREFILL_SCORES_BUDGET = 1 << 26
# Seconds the method-state pools keep the most slots a load used at once after its use fell below that
# (MethodGroup.shrink): a batch of streams whose requests end together and come back at once reuses them instead
# of regrowing the pools 1 -> 2 -> 4 -> 8, copying the slots in use each time; an idle server gives them
# back this long after its last request (the engine's idle passes call ModelRunner.trim_pools).
HOLD_S = 5.0


class MethodGroup:
    """One method instance and its per-layer state pools, shared by every session with the same MethodSpec.

    With a CacheBudget the pools' bytes count against it: ``alloc`` grows every layer's pool together
    (doubling, capped by the budget; all layers or none) and raises BudgetExceeded when not even one
    more slot fits; ``shrink`` gives back the slots above the highest in use once at most a quarter of the pools
    is needed (all but one when none is), keeping for ``HOLD_S`` the most slots in use at once (``peak``: a
    high-water mark that lapses ``HOLD_S`` after use fell below it) and the room ``make_free`` made for sessions
    about to come, and ``close`` the rest when the runner drops the group.
    """

    def __init__(self, method: AttentionMethod, num_layers: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, device: torch.device | str, budget: CacheBudget | None = None) -> None:
        self.method = method
        self.budget = budget
        try:
            self.states: list[SlotPool] = [method.init_state(num_heads, num_kv_heads, head_dim, device=device)
                                           for _ in range(num_layers)]
        except OUT_OF_MEMORY as e:
            raise allocation_failed("the method state", 0, budget, e) from e
        self.reserved = sum(state.capacity * state.nbytes_per_slot() for state in self.states)
        self._slot_key, self._slot_bytes = -1, 0  # slot_nbytes's: the layers' summed generations it was taken at
        if budget is not None:
            budget.charge(self.reserved, "the method state")
        self.clock = time.monotonic
        self.peak, self.peak_at = 0, -HOLD_S  # the most slots in use at once lately, and when use left it
        self.deferred = False  # the last shrink kept slots for the hold: trim_pools shrinks again once it lapses
        self.held = 0  # free slots ``make_free`` keeps for sessions about to come: ``shrink`` leaves them
        # whole_step.py's prepared layers of this group's method, per attention kind: (decoder, pool, key, plan)
        self.plans: dict[int, tuple] = {}

    @property
    def used_slots(self) -> int:
        state = self.states[0]
        return state.capacity - state.free_slots

    def alloc(self, session_id: str | None = None, fresh: bool = True) -> list[int]:
        """One slot in every layer's pool (the same id in each), growing them first when full; ``fresh=False``:
        not reset, for ``write_state`` of a whole state next (SlotPool.alloc)."""
        if any(state.free_slots == 0 for state in self.states):
            self._grow(session_id)
        slots = [state.alloc(fresh) for state in self.states]
        self.held = max(0, self.held - 1)
        used, now = self.used_slots, self.clock()
        if used >= self.peak or now - self.peak_at > HOLD_S:
            self.peak, self.peak_at = used, now
        return slots

    def make_free(self, need: int) -> None:
        """At least ``need`` free slots as far as the budget allows, grown once to just that (sessions about to
        come in, whose slots a doubling per few sessions would copy the pools for). ``shrink`` leaves them free
        until as many slots have been allocated since, or memory is short."""
        state = self.states[0]
        if need > state.free_slots:
            try:
                self._grow(None, state.capacity + need - state.free_slots)
            except BudgetExceeded:  # not one more slot fits: the sessions' own imports say so, if they come
                pass
        self.held = max(self.held, min(need, state.free_slots))

    def _grow(self, session_id: str | None, want: int | None = None) -> None:
        """Every layer's pools to ``want`` slots (default: twice as many), capped by the budget."""
        capacity, per_slot = self.states[0].capacity, self.slot_nbytes()
        new = want or 2 * capacity
        if self.budget is not None:
            new = min(new, capacity + self.budget.free // max(1, per_slot))
            if new <= capacity:
                raise BudgetExceeded("the method state", per_slot, self.budget.free, self.budget.limit, session_id)
        try:
            grown = [state.prepare_grow(new) for state in self.states]
        except OUT_OF_MEMORY as e:
            raise allocation_failed("the method state", (new - capacity) * per_slot, self.budget, e) from e
        if self.budget is not None:
            self.budget.charge((new - capacity) * per_slot, "the method state", session_id)
        self.reserved += (new - capacity) * per_slot
        for state, tensors in zip(self.states, grown, strict=True):
            state.commit_grow(new, tensors)

    def close(self) -> None:
        """The group is dropped: its bytes go back to the budget."""
        if self.budget is not None:
            self.budget.refund(self.reserved)
        self.reserved = 0

    def free(self, slots: list[int]) -> None:
        if self.used_slots >= self.peak:  # use falls below the peak now: its hold starts
            self.peak_at = self.clock()
        for state, slot in zip(self.states, slots, strict=True):
            state.free(slot)

    def shrink(self, hold: bool = True) -> int:
        """Every layer's pool down to the power of two that holds its highest slot in use, the room ``make_free``
        holds and, until ``HOLD_S`` after use fell below it, ``peak`` (``hold``: False under memory pressure: neither
        room is kept), when that is at most a quarter of its
        capacity or no slot is in use (so that a load that comes and goes does not resize the pools at every
        session) -> bytes given back to the budget."""
        capacity = self.states[0].capacity
        if not hold:
            self.held = 0
        top = max(max(state.highest_used() for state in self.states) + 1, self.used_slots + self.held)

        def size(keep: int) -> int:  # the power of two >= keep (1 when none is used); capacity: no shrink
            new = 1 << max(0, keep - 1).bit_length()
            return capacity if new >= capacity or (top and 4 * new > capacity) else new

        new = size(top)
        if hold and self.clock() - self.peak_at <= HOLD_S:
            new = size(max(top, self.peak))
            self.deferred = new > size(top)
        else:
            self.deferred = False
        if new == capacity:
            return 0
        per_slot = self.slot_nbytes()
        for state in self.states:
            state.shrink(new)
        freed = (capacity - new) * per_slot
        self.reserved -= freed
        if self.budget is not None:
            self.budget.refund(freed)
        return freed

    def copy_state(self, src: list[int], dst: list[int]) -> None:
        """Per layer, slot ``dst[l]`` takes the contents of slot ``src[l]`` (ModelRunner.fork)."""
        for state, s, d in zip(self.states, src, dst, strict=True):
            state.copy_slot(s, d)

    def read_state(self, slots: list[int]) -> dict[str, torch.Tensor]:
        """One session's state, every layer: field f -> (num_layers, *f's per-slot shape), a copy."""
        per_layer = [state.read_slot(s) for state, s in zip(self.states, slots, strict=True)]
        return {name: torch.stack([layer[name] for layer in per_layer]) for name in self.states[0].fields}

    def write_state(self, slots: list[int], tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of ``read_state``: layer l's slot ``slots[l]`` takes ``tensors[f][l]`` for every field f.
        ValueError (naming the field) before any layer is written when a field is missing or its shape differs."""
        for name, t in tensors.items():
            if t.shape[0] != len(self.states):
                raise ValueError(f"state field {name!r} holds {t.shape[0]} layers, the model has {len(self.states)}")
        layers = [{name: t[i] for name, t in tensors.items()} for i in range(len(self.states))]
        for state, layer in zip(self.states, layers, strict=True):  # every layer checked before any is written
            state.check_slot(layer)
        for state, s, layer in zip(self.states, slots, layers, strict=True):
            state.write_slot(s, layer, checked=True)  # checked just above: once is enough

    def reset(self, slots: list[int]) -> None:
        """Per layer, slot ``slots[l]`` back to a fresh session's state (a session rewound, engine/turn.py)."""
        for state, s in zip(self.states, slots, strict=True):
            state.clear_slot(s)

    def slot_nbytes(self) -> int:
        """Bytes of one session's state, every layer: Σ_l states[l].nbytes_per_slot(). Summed again only when a
        layer's tensors were replaced (SlotPool.generation): a slot's size changes only so, with Quest's pages and
        Loki's tokens (``ensure_extent``), never with ReTopK's; every ``open_session`` and metrics read asks."""
        key = sum(state.generation for state in self.states)  # each generation only grows (whole_step.py's key)
        if key != self._slot_key:
            self._slot_key, self._slot_bytes = key, sum(state.nbytes_per_slot() for state in self.states)
        return self._slot_bytes

    def prefill(self, layer: int, slot: int, q: torch.Tensor | None, positions: torch.Tensor | None, kv,
                scale: float) -> None:
        """q (H, T, d) the last queries of the new tokens (or None) -> the method's state updated."""
        self.method.prefill(self.states[layer], slot, q, positions, kv, scale=scale)

    def decode(self, layer: int, q: torch.Tensor, kv, slots: torch.Tensor, scale: float):
        """q (n, H, d) -> StepOutput, scored with the model's softmax scale."""
        return self.method.decode(q, kv, self.states[layer], slots, scale=scale)


@dataclass
class DecodeGroup:
    group: MethodGroup
    rows: torch.Tensor | None  # (n,) batch rows of this group on the device; None = every row
    slots: torch.Tensor  # (layers, n) int64 state slots on the device


@dataclass
class StepKV:
    """Where one forward's new keys and values go, and how far each row reaches.

    table         (B, max_blocks) int64 block table of the rows
    start         (B,) int64 position of each row's first new token
    lengths       (B,) int64 positions valid after this step's tokens are written
    """

    pool: KVPool
    table: torch.Tensor
    start: torch.Tensor
    lengths: torch.Tensor
    rows: torch.Tensor | None = None  # (B, H_kv, T) pool rows of the new tokens (KVPool.rows), made on first use

    def new_rows(self, T: int) -> torch.Tensor:
        """``rows`` of the T new tokens a row, made from the table on first use (a decode step passes them made)
        and shared by every layer."""
        if self.rows is None:
            self.rows = self.pool.rows(self.table, self.start, T)
        return self.rows

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, H_kv, T, d) -> written at each row's positions start .. start + T - 1."""
        self.pool.write(layer, self.new_rows(k.shape[2]), k, v)


@dataclass
class PrefillSegment:
    """One session's chunk in a prefill forward: rows ``offset`` .. ``offset + T - 1`` of its token axis (prefill.py).

    kv            the session's block table (1, max_blocks), start (1,) = first, lengths (1,) = first + T
    first         python int copy of kv.start[0]
    last          this chunk ends the prompt: the method observes its tail queries after the forward
    tail_start    first position whose query is kept (the method wants the last ``prefill_queries`` of them)
    tails         layer -> (H, t, d) queries kept by the session's earlier chunks (read only here)
    kept          layer -> (H, t', d) the queries this chunk keeps; the job appends them to ``tails`` once
                  the forward has finished
    """

    kv: StepKV
    group: MethodGroup
    slots: list[int]  # the session's state slot in each layer
    first: int
    offset: int
    T: int
    last: bool
    tail_start: int
    tails: dict[int, torch.Tensor]
    kept: dict[int, torch.Tensor] = field(default_factory=dict)

    def observe(self, scale: float) -> None:
        """After the forward of the prompt's last chunk (``tails`` holding its queries): every layer's method
        observes the prompt's last ``prefill_queries`` queries (``method.prefill``)."""
        want, L = self.group.method.prefill_queries, self.first + self.T
        for layer in range(len(self.group.states)):
            # the tails may start before the last ``want`` (the prefix cache keeps some of them, prefill.py)
            q_tail = self.tails[layer][:, -want:] if want > 0 and layer in self.tails else None
            positions = None
            if q_tail is not None:
                positions = torch.arange(L - q_tail.shape[1], L, device=q_tail.device)
            kv = self.kv.pool.paged(layer, self.kv.table[:1], self.kv.lengths[:1])
            self.group.prefill(layer, self.slots[layer], q_tail, positions, kv, scale)


@dataclass
class PrefillContext:
    """One chunk of each of several sessions' prompts in one forward (prefill.py), ``segments`` in the order of
    their rows; ``rows`` (1, H_kv, N) the pool rows of all N new tokens, made on first use (every layer's)."""

    segments: list[PrefillSegment]
    rows: torch.Tensor | None = None
    scale: float = 0.0  # the model's softmax scale, as the layers pass it (the methods observe with it)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (1, H, N, d), k, v (1, H_kv, N, d) after RoPE -> (1, H, N, d): each segment's rows attend densely and
        causally to its own session only."""
        segments, self.scale = self.segments, scale
        pool = segments[0].kv.pool
        if self.rows is None:
            self.rows = torch.cat([pool.rows(seg.kv.table, seg.kv.start, seg.T) for seg in segments], dim=2)
        ks, vs = pool.stored(k), pool.stored(v)  # (1, H_kv, N, d) in the pool's dtype: cast once for all sessions
        pool.write(layer, self.rows, ks, vs)  # every session's new keys and values in one store
        if any(seg.first == 0 for seg in segments):  # sessions whose chunk is their whole history read them back
            k, v = ks.to(k.dtype), vs.to(v.dtype)  # as the pool holds them (KVPool.as_stored)
        if len(segments) == 1:
            return _prefill(segments[0], layer, q, k, v, scale)
        # (1, N, H, d), returned as its (1, H, N, d) view: the layer's (N, H d) reshape of it is free
        out = q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        together = [seg for seg in segments if _whole(seg, q)] if decoder_ops.available() else []
        if len(together) < 2:  # one such session alone gains nothing from the team's split: _prefill's own call
            together = []
        if together:  # those sessions a thread each of the team, in one library call
            decoder_ops.causal_attention_segments_(out, q, k, v, [seg.offset for seg in together],
                                                   [seg.T for seg in together], scale)
            for seg in together:
                _keep(seg, layer, q[:, :, seg.offset:seg.offset + seg.T])
        done = {id(seg) for seg in together}
        for seg in segments:
            if id(seg) in done:
                continue
            rows = slice(seg.offset, seg.offset + seg.T)
            out[:, rows] = _prefill(seg, layer, q[:, :, rows], k[:, :, rows], v[:, :, rows], scale).transpose(1, 2)
        return out.transpose(1, 2)


@dataclass
class DecodeContext:
    """One token for each of B sessions, grouped by method (ModelRunner.decode)."""

    kv: StepKV
    groups: list[DecodeGroup]
    with_stats: bool = False
    # per group: per layer (path, max_sim, n_scored); host tensors once the last layer has run
    stats: list[list[tuple]] = field(default_factory=list)
    attention_s: list[float] = field(default_factory=list)  # per group, summed over layers
    events: list[list[tuple]] = field(default_factory=list)  # per group: per layer (start, end) CUDA events

    def __post_init__(self) -> None:
        self.stats = self.stats or [[] for _ in self.groups]
        self.attention_s = self.attention_s or [0.0 for _ in self.groups]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q (B, H, 1, d), k, v (B, H_kv, 1, d) after RoPE -> (B, H, 1, d), each method group on its rows."""
        self.kv.store(layer, k, v)
        return _decode(self, layer, q[:, :, 0], scale).unsqueeze(2)


def _event_timing(device: torch.device) -> bool:
    """Time the attention core with CUDA events (True on a CUDA device) rather than the host clock."""
    return device.type == "cuda"


def to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors on the host in ONE device-to-host copy: their bytes packed into one uint8 buffer
    on the device, copied, and viewed back (bit for bit: NaN, int8, int32 alike)."""
    if not tensors:
        return []
    flat, sizes = [], []
    for t in tensors:
        f = t.contiguous().view(-1).view(torch.uint8)  # (nbytes,)
        sizes.append(f.numel())
        flat += [f, f.new_zeros(-f.numel() % 8)]  # padded to 8 bytes: every piece's view stays aligned
    host = torch.cat(flat).cpu()  # the step's only device -> host transfer
    out, at = [], 0
    for t, n in zip(tensors, sizes, strict=True):
        out.append(host[at:at + n].view(t.dtype).view(t.shape))
        at += n + (-n % 8)
    return out


def _finish_stats(ctx: DecodeContext) -> None:
    """After the last layer: every group's per-layer statistics to the host in one copy, and the
    attention time of each group from its CUDA events (complete once that copy has returned)."""
    flat = [t for per_layer in ctx.stats for row in per_layer for t in row]
    host = iter(to_host(flat))
    ctx.stats = [[tuple(next(host) for _ in row) for row in per_layer] for per_layer in ctx.stats]
    for gi, pairs in enumerate(ctx.events):
        ctx.attention_s[gi] += sum(start.elapsed_time(end) for start, end in pairs) / 1000.0
        pairs.clear()


def _prefill(seg: PrefillSegment, layer: int, query: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
             scale: float) -> torch.Tensor:
    """One session's chunk: query (1, H, T, d), its keys and values k_new, v_new (1, H_kv, T, d), already written
    to the pool and, where the chunk starts the session (``seg.first`` 0), rounded as the pool holds them
    (``KVPool.as_stored``) -> (1, H, T, d) dense causal attention over the session's keys as the pool holds them;
    the queries the method will observe go to ``seg.kept``."""
    _, H, T, _ = query.shape
    s = seg.first
    L = s + T
    pool = seg.kv.pool
    if s == 0:  # the chunk is the whole history: its own keys and values, rounded as stored, not gathered back
        k, v = k_new.to(query.dtype), v_new.to(query.dtype)  # (1, H_kv, L, d)
    else:
        k, v = pool.history(layer, seg.kv.table[0], L)  # (H_kv, L, d)
        k, v = k.unsqueeze(0).to(query.dtype), v.unsqueeze(0).to(query.dtype)  # (1, H_kv, L, d)
    gqa = H != k.shape[1]
    if s == 0 and H * T * L <= PREFILL_SCORES_BUDGET:
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # query rows in blocks so that a score matrix (H, rows, keys) stays within the budget
        rows = max(1, PREFILL_SCORES_BUDGET // (H * L))
        out = torch.empty_like(query)
        for i in range(0, T, rows):
            j = min(T, i + rows)
            end = s + j  # the block's last query sees keys 0..end-1
            qpos = torch.arange(s + i, end, device=query.device).view(-1, 1)
            mask = torch.arange(end, device=query.device).view(1, end) <= qpos  # (j - i, end)
            out[:, :, i:j] = F.scaled_dot_product_attention(query[:, :, i:j], k[:, :, :end], v[:, :, :end],
                                                            attn_mask=mask, scale=scale, enable_gqa=gqa)
    _keep(seg, layer, query)
    return out


def _whole(seg: PrefillSegment, query: torch.Tensor) -> bool:
    """Whether ``_prefill`` attends over ``seg``'s chunk (of ``query``'s device) as one causal SDPA call on the chunk
    alone: the chunk starts its session and its score matrix fits the budget (decoder_ops.causal_attention_segments_
    makes those calls for several sessions at once, on the CPU)."""
    H = query.shape[1]
    return seg.first == 0 and H * seg.T * seg.T <= PREFILL_SCORES_BUDGET and query.device.type == "cpu"


def _keep(seg: PrefillSegment, layer: int, query: torch.Tensor) -> None:
    """The chunk's queries query (1, H, T, d) that the method will observe -> ``seg.kept[layer]``."""
    s, L = seg.first, seg.first + seg.T
    first = max(seg.tail_start, s)
    if seg.group.method.prefill_queries > 0 and first < L:
        seg.kept[layer] = query[0, :, first - s:]  # (H, t, d)


def _decode(ctx: DecodeContext, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
    """One token per row: q (B, H, d) -> (B, H, d), each method group on its own rows."""
    out = None
    by_events = _event_timing(q.device)
    if ctx.with_stats and by_events and len(ctx.events) < len(ctx.groups):
        ctx.events = [[] for _ in ctx.groups]
    for gi, dg in enumerate(ctx.groups):
        if ctx.with_stats:
            if by_events:  # recorded on the stream: no host wait
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
        if dg.rows is None:
            kv = ctx.kv.pool.paged(layer, ctx.kv.table, ctx.kv.lengths)
            res = dg.group.decode(layer, q, kv, dg.slots[layer], scale)
            out = res.out
        else:
            kv = ctx.kv.pool.paged(layer, ctx.kv.table.index_select(0, dg.rows),
                                   ctx.kv.lengths.index_select(0, dg.rows))
            res = dg.group.decode(layer, q.index_select(0, dg.rows), kv, dg.slots[layer], scale)
            if out is None:
                out = q.new_empty(q.shape[0], q.shape[1], res.out.shape[-1])
            out.index_copy_(0, dg.rows, res.out.to(out.dtype))
        if ctx.with_stats:
            if by_events:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                ctx.events[gi].append((start, end))
            else:
                ctx.attention_s[gi] += time.perf_counter() - t0
            ctx.stats[gi].append((res.path, res.max_sim, res.n_scored))
    if ctx.with_stats and ctx.groups and layer == ctx.groups[0].slots.shape[0] - 1:
        _finish_stats(ctx)
    return out
