"""ReTopK: recall similar past queries, rerank the union of their Top-K supports (the paper's Method).

Per query head, a FIFO of capacity C holds (unit-norm query q̄_c, support Ŝ_c) pairs (eq. 5). A decode
step with current query q_t over L_t cached keys:

    ρ_c   = q̄_t · q̄_c                                  similarity to each cached query   (eq. 6)
    R_t   = TopR_c ρ_c,   ρ_max = max_c ρ_c              recall                           (eq. 7)
    A_t   = Unique(∪_{c∈R_t} Ŝ_c ∪ {L_t-W, ..., L_t-1})  candidates, M_t = |A_t| <= RK + W (eq. 8, 9)
    ê_i   = q_t · k_i / sqrt(d),  i ∈ A_t                exact scores of candidates only  (eq. 10)
    Ŝ_t   = TopK_{i∈A_t} ê_i                             rerank                           (eq. 11)
    o_t   = Σ_{i∈Ŝ_t} softmax(ê)_i v_i                    sparse attention                 (eq. 12)

Path (eq. 13): REFRESH when T_r > 0 and t_dec ∈ {T_r, 2T_r, ...} (t_dec = 0 on the first decode
step after the first prefill; with ``refresh_stagger``, t_dec > 0 and t_dec + φ ≡ 0 mod T_r for the
phase φ of the head's (layer, KV group), see ``refresh_phases``; with ``refresh_guard`` the head's own
period T_h, a power-of-two divisor of T_r moved online by ``guard_period``, replaces T_r), and on every
step with t_dec < 0 (``refresh_first`` = N: each prefill sets t_dec = -N, so the first N steps of each
turn's answer are exact); else FALLBACK
to Exact Top-K when ρ_max < tau (an empty cache has ρ_max = -inf); else REUSE. Under GQA the G heads of a KV group share
its keys, and a group is read in full when any of its heads takes an exact path: ``config.gqa_policy``
turns the per-head decisions into per-group ones (``gqa_paths``: the paper's per-head rule, "promote"
or "group"), and every head of a read group may then take the exact support (PROMOTED). After any
path (q̄_t, Ŝ_t) enters the FIFO. Only indices are reused: scores, weights and outputs always come
from the current query and the real KV cache.

The FIFO is initialised at prefill from the final C prompt queries, each with its exact causal
Top-K support over the prompt; a later turn's prefill pushes its final queries the same way.
Positions are 0-based here (the paper's window {L-W+1..L} in 1-based positions).
"""

from __future__ import annotations

import torch

from retopk_core.fidelity import mass_recall, support_recall
from retopk_core.kv import PagedKV
from retopk_core.methods import state_bounds
from retopk_core.methods.backend_steps import steps_for
from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput, constant, uniform_output
from retopk_core.methods.retopk_policy import (
    below_floor,
    calibrate_tau,
    gqa_paths,
    guard_floor,
    guard_period,
    guard_tau,
    head_paths,
    plain_dense,
    refresh_phases,
)
from retopk_core.methods.sparse import (
    NEG_INF,
    SHORT_BATCH_KEYS,
    Workspace,
    exact_select,
    group_scores,
    indexed_scores,
    kv_heads,
    resolve_scale,
    sparse_attend,
    topk_select,
)
from retopk_core.retopk_config import ReTopKConfig


class QuerySupportCache(SlotPool):
    """One layer's query-support FIFOs, for every slot (sequence) and query head.

    queries (S, H, C, d) float32   unit-norm cached queries q̄_c
    support (S, H, C, K) int64     their supports Ŝ_c, -1 padded (prompts shorter than K); with the
                                   Triton backend (its prefill and steps) rows by position, -1s last;
                                   the torch and CPU code read them as sets, in any order
    fill    (S,) int64             valid entries (every head of a sequence inserts on every step,
    ptr     (S,) int64             so the fill count and write pointer are shared by its heads)
    step    (S,) int64             decode steps taken since the first prefill (t_dec); with
                                   ``refresh_first`` = N, since the last prefill, less N
    tau     (S, H) float32         each head's fallback threshold (config.tau; moved by ``calibrate_tau``;
                                   the CPU and Triton kernels read and move it in place)
    period  (S, H) int64           each head's refresh period T_h (config.refresh_every; under
                                   ``refresh_guard`` it starts at ``guard_floor`` and ``guard_period`` moves it;
                                   the CPU and Triton kernels read and move it in place)
    phase   (H,) int64             each head's refresh phase φ (the layer's, not per slot; 0 = the paper)
    """

    _fields = ("queries", "support", "fill", "ptr", "step", "tau", "period")

    def __init__(self, num_heads: int, head_dim: int, config: ReTopKConfig, device: torch.device | str = "cpu",
                 capacity: int = 1) -> None:
        C, K = config.cache_size, config.top_k
        super().__init__(capacity)
        self.queries = torch.zeros(self.capacity, num_heads, C, head_dim, dtype=torch.float32, device=device)
        self.support = torch.full((self.capacity, num_heads, C, K), -1, dtype=torch.long, device=device)
        self.fill = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.ptr = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.step = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.tau0 = config.tau
        self.tau = torch.full((self.capacity, num_heads), config.tau, dtype=torch.float32, device=device)
        # refresh_guard: every head starts at the shortest period and earns the longer ones (guard_period)
        self.period0 = guard_floor(config.refresh_every) if config.refresh_guard else config.refresh_every
        self.period = torch.full((self.capacity, num_heads), self.period0, dtype=torch.long, device=device)
        self.phase = torch.zeros(num_heads, dtype=torch.long, device=device)

    # The FIFO's rows and a new pool's value of each. A slot's rows at or past ``fill`` are never read: every
    # reader selects rows c < fill before anything else uses them (``_similarity`` masks ρ to -inf there, the
    # recall keeps finite ρ or ages <= fill, the CPU kernel's loops stop at fill, the Triton selector takes
    # tl.where(c < fill, ...)), and while fill < C the pushes have written exactly rows 0 .. fill - 1 (ptr = fill).
    # So a new sequence's reset leaves them as they are (they are nearly all of a slot's bytes), and
    # ``read_slot`` exports them as a new pool's values.
    _rows = {"queries": 0.0, "support": -1}

    def reset_slot(self, slot: int) -> None:
        """The counters and thresholds of ``slot`` to a new sequence's values (fill, ptr and step 0, tau and period
        their starting values); the FIFO rows stay as they are: with fill 0 none is read (``_rows``)."""
        self.fill[slot] = 0
        self.ptr[slot] = 0
        self.step[slot] = 0
        self.tau[slot] = self.tau0
        self.period[slot] = self.period0

    def _copy_used(self, name: str, new: torch.Tensor, runs: list[tuple[int, int]]) -> None:
        """``SlotPool._copy_used`` with only the FIFO rows below each slot's fill (``_rows``): a wave of sessions
        grows the pools between their admissions, before any of them has pushed a row."""
        if name not in self._rows:
            return super()._copy_used(name, new, runs)
        t, fill = getattr(self, name), self.fill.tolist()  # one read of the counters (a GPU pool's: one sync)
        for slot in (s for a, e in runs for s in range(a, e)):
            new[slot, :, :fill[slot]] = t[slot, :, :fill[slot]]

    def copy_slot(self, src: int, dst: int) -> None:
        """``SlotPool.copy_slot`` with only the FIFO rows below ``src``'s fill (``_rows``)."""
        f = int(self.fill[src])
        with self._own_mode():
            for name in self._fields:
                t = getattr(self, name)
                if name in self._rows:
                    t[dst, :, :f] = t[src, :, :f]
                else:
                    t[dst] = t[src]

    def read_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """``SlotPool.read_slot`` with the FIFO rows at or past ``fill`` as a new pool's (queries 0, support -1),
        not whatever an earlier sequence of the slot left there (``_rows``)."""
        f = int(self.fill[slot])
        out = {}
        for name in self._fields:
            t = getattr(self, name)[slot]
            if name in self._rows:  # (H, C, ...): rows 0 .. f - 1 are the sequence's
                rows = t.new_full(t.shape, self._rows[name])
                rows[:, :f] = t[:, :f]
                out[name] = rows
            else:
                out[name] = t.clone()
        return out

    def push(self, slots: torch.Tensor, qn: torch.Tensor, support: torch.Tensor) -> None:
        """Insert one entry per (slot, head): slots (B,), qn (B, H, d), support (B, H, K)."""
        B, H, _ = qn.shape
        heads = torch.arange(H, device=qn.device).view(1, H)
        at = self.ptr[slots].view(B, 1)  # (B, 1)
        self.queries[slots.view(B, 1), heads, at] = qn
        self.support[slots.view(B, 1), heads, at] = support
        self.advance(slots)

    def push_many(self, slot: int, qn: torch.Tensor, support: torch.Tensor) -> None:
        """Insert T <= C consecutive entries into every head of one slot: qn (H, T, d), support (H, T, K)."""
        C, T = self.queries.shape[2], qn.shape[1]
        at = (self.ptr[slot] + torch.arange(T, device=qn.device)) % C  # (T,) FIFO rows, oldest first
        self.queries[slot].index_copy_(1, at, qn)  # (H, C, d); a strided copy, not an index scatter
        self.support[slot].index_copy_(1, at, support)  # (H, C, K)
        self.ptr[slot] = (self.ptr[slot] + T) % C
        self.fill[slot] = (self.fill[slot] + T).clamp(max=C)

    def advance(self, slots: torch.Tensor) -> None:
        """Move the write pointer and fill count past the entry just written at each slot (B,)."""
        C = self.queries.shape[2]
        self.ptr[slots] = (self.ptr[slots] + 1) % C
        self.fill[slots] = (self.fill[slots] + 1).clamp(max=C)


class ReTopK(AttentionMethod):
    name = "retopk"
    config_class = ReTopKConfig
    backends = ("torch", "triton", "cpu")  # cpu: the fused C++ kernel (retopk_core/cpu), else the torch code

    def __init__(self, config: ReTopKConfig | None = None, backend: str = "torch") -> None:
        """``ReTopK(ReTopKConfig(top_k=64, gqa_policy="group"))``; by name: ``make_method("retopk", top_k=64)``."""
        super().__init__(config, backend)
        self.prefill_queries = self.config.cache_size
        self._ws = Workspace()  # gathered candidate keys and selected values, reused across steps
        self.steps = steps_for(self.backend)  # methods/backend_steps.py
        self._layers = 0  # init_state is called once per model layer, in layer order (as FidelityProbe's)

    def init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                   capacity: int = 1) -> QuerySupportCache:
        """The next layer's state; with ``refresh_stagger`` its heads get that layer's refresh phases."""
        state = QuerySupportCache(num_heads, head_dim, self.config, device, capacity)
        if self.config.refresh_stagger and self.config.refresh_every > 0:
            state.phase = refresh_phases(self._layers, num_heads, num_kv_heads, self.config.refresh_every).to(device)
        self._layers += 1
        return state

    def check_state(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """Supports are positions in [-1, length) (a kernel gathers keys at them), the fill count in [0, C], the
        write pointer in [0, C), the step counter >= 0, thresholds and queries finite, refresh periods within
        [guard_floor(T_r), T_r] (a kernel divides by them; T_r = 0, no refresh: every period is 0)."""
        state_bounds.require(tensors, QuerySupportCache.field_names())
        C = tensors["queries"].shape[2] if tensors["queries"].dim() == 4 else 0
        state_bounds.integers_within(tensors, "support", -1, length - 1, "positions of the session's tokens")
        state_bounds.integers_within(tensors, "fill", 0, C)
        state_bounds.integers_within(tensors, "ptr", 0, max(C, 1) - 1)
        state_bounds.integers_within(tensors, "step", -self.config.refresh_first, 2**62)
        state_bounds.finite(tensors, "queries", "tau")
        T_r = self.config.refresh_every
        state_bounds.integers_within(tensors, "period", min(guard_floor(T_r), T_r), T_r,
                                     f"refresh periods of refresh_every = {T_r}")

    # -- prefill ---------------------------------------------------------------------------------
    def prefill(self, state: QuerySupportCache, slot: int, q: torch.Tensor | None, positions: torch.Tensor | None,
                kv: PagedKV, scale: float | None = None) -> None:
        """Push the prompt's final queries with their exact causal Top-K supports (equation 5), all T of a
        layer in one write. Skipped when the dense floor will refill the FIFO first: after a prompt of L
        positions with L + C < dense_below, the decode steps at L_t = dense_below - C, ..., dense_below - 1
        (L_t counts the current token) are C dense steps that each push an exact support (``_dense_step``)
        before the first sparse one. With ``refresh_first`` = N the turn's decode starts at t_dec = -N: its first N
        steps refresh (``head_paths``)."""
        cfg = self.config
        if q is None or q.shape[1] == 0:
            return
        if cfg.refresh_first:
            state.step[slot] = -cfg.refresh_first
        L = int(kv.lengths[0])
        if L + cfg.cache_size < cfg.dense_below:
            return
        q, positions = q[:, -cfg.cache_size:], positions[-cfg.cache_size:]
        H, T, d = q.shape
        scale = resolve_scale(scale, d)
        K, G = cfg.top_k, H // kv.num_kv_heads
        support = torch.empty(H, T, K, dtype=torch.long, device=q.device)
        pos = torch.arange(L, device=q.device)
        causal = pos.view(1, L) <= positions.view(T, 1)  # (T, L): query at p sees keys 0..p
        H_kv = kv.num_kv_heads
        if L <= K:  # every visible key is in the Top-K: the supports are the causal masks, no scores needed
            support = torch.where(causal, pos.view(1, L), -1)  # (T, L)
            support = torch.cat([support, support.new_full((T, K - L), -1)], dim=1).expand(H, T, K)
        elif H * T * L <= SHORT_BATCH_KEYS:  # a short prompt: every group in one matmul and one Top-K
            qs = q.float().reshape(H_kv, G * T, d) * scale  # (H_kv, G*T, d)
            scores = group_scores(qs, kv, 0, L).view(H, T, L).masked_fill(~causal, NEG_INF)  # (H, T, L)
            support = self._seed_topk(scores.view(H * T, L), K).view(H, T, K)
        # every query sees the keys before the first of them: only the columns from there on need the mask
        seen = int(positions.min()) + 1 if T else L
        for g in range(H_kv if L > K and H * T * L > SHORT_BATCH_KEYS else 0):  # one group's (G*T, L) scores at a time
            qs = q[g * G:(g + 1) * G].float().reshape(1, G * T, d) * scale  # (1, G*T, d)
            scores = group_scores(qs, kv, 0, L, group=g)[0].view(G, T, L)  # (G, T, L)
            scores[..., seen:].masked_fill_(~causal[:, seen:], NEG_INF)
            support[g * G:(g + 1) * G] = self._seed_topk(scores.view(G * T, L), K).view(G, T, K)
        if L > K and self.steps.sorted_seeds:  # Top-K rows come in score order (the causal masks are sorted)
            support = by_position(support)  # for the selector's merge-only path; a sort a layer, so not for
            # the torch and CPU steps, which read supports as sets
        state.push_many(slot, _unit(q), support)

    def _seed_topk(self, scores: torch.Tensor, K: int) -> torch.Tensor:
        """Each row's Top-K positions (N, L) -> (N, K) int64 (the fused CPU kernel's one pass per row on the cpu
        backend: torch.topk's partial sort of every row was most of a seeding's cost)."""
        return self.steps.seed_topk(scores, K)

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, q: torch.Tensor, kv: PagedKV, state: QuerySupportCache, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        scale = resolve_scale(scale, q.shape[-1])
        if self.steps.retopk_floor:  # the whole step on the device, the floor and tau_calibration included
            return self.steps.retopk(self, q, kv, state, slots, scale)
        if self.config.dense_below:
            dense = below_floor(kv.lengths, self.config)  # (B,) below the floor: attend to everything
            if bool(dense.any()):
                return self._split_dense(q, kv, state, slots, scale, dense)
        return self._sparse_step(q, kv, state, slots, scale)

    def _split_dense(self, q: torch.Tensor, kv: PagedKV, state: QuerySupportCache, slots: torch.Tensor,
                     scale: float, dense: torch.Tensor) -> StepOutput:
        """The dense floor: rows with ``dense`` (B,) attend densely, the others take the sparse step."""
        if bool(dense.all()):
            return self._dense_step(q, kv, state, slots, scale)
        parts = []
        for rows in (dense.nonzero().flatten(), (~dense).nonzero().flatten()):  # (n,) each
            sub = PagedKV(kv.k_pool, kv.v_pool, kv.block_table.index_select(0, rows), kv.lengths.index_select(0, rows))
            step = self._dense_step if not parts else self._sparse_step
            parts.append((rows, step(q.index_select(0, rows), sub, state, slots.index_select(0, rows), scale)))
        merged = {}
        for name in ("out", "path", "max_sim", "n_scored", "selected"):
            first = getattr(parts[0][1], name)
            t = first.new_empty((q.shape[0], *first.shape[1:]))
            for rows, res in parts:
                t.index_copy_(0, rows, getattr(res, name).to(t.dtype))
            merged[name] = t
        return StepOutput(**merged)

    def _dense_step(self, q: torch.Tensor, kv: PagedKV, state: QuerySupportCache, slots: torch.Tensor,
                    scale: float) -> StepOutput:
        """Full attention for every head (path DENSE). Rows within C steps of the floor
        (L_t + C >= dense_below) also push (q̄_t, TopK of the same scores) into the FIFO, so it holds C exact
        entries when sparse decoding starts. Earlier rows push nothing and select nothing (``selected``
        -1): the FIFO keeps only its last C entries, so their pushes would be overwritten unread, and
        without them a step costs what Full attention's does."""
        B, H, _ = q.shape
        K = self.config.top_k
        push = ~plain_dense(kv.lengths, self.config)  # (B,)
        if bool(push.any()):
            out, sel_pos = self.steps.dense_topk(q, kv, scale, K)  # (B, H, d_v), (B, H, K)
            if bool(push.all()):
                state.push(slots, _unit(q), sel_pos)
            else:
                rows = push.nonzero().flatten()  # (n,)
                sel_pos.masked_fill_(~push.view(B, 1, 1), -1)
                state.push(slots.index_select(0, rows), _unit(q.index_select(0, rows)), sel_pos.index_select(0, rows))
        else:
            out = self.steps.dense(q, kv, scale)  # Full's step
            sel_pos = constant((B, H, K), -1, torch.long, q.device)
        state.step[slots] += 1
        return uniform_output(out, Path.DENSE, kv.lengths, sel_pos)

    def _sparse_step(self, q: torch.Tensor, kv: PagedKV, state: QuerySupportCache, slots: torch.Tensor,
                     scale: float) -> StepOutput:
        """ReTopK's step proper (eq. 6-13): the backend's kernel where it has one (triton: see ``decode``), else the
        torch code below."""
        cfg = self.config
        if (fused := self.steps.retopk(self, q, kv, state, slots, scale)) is not None:
            return fused
        B, H, d = q.shape
        qn = _unit(q)  # (B, H, d) float32

        sim, max_sim = self._similarity(qn, state, slots)  # (B, H, C), (B, H)
        own_tau = cfg.tau_calibration or cfg.tau_guard  # the heads' thresholds move
        tau = state.tau.index_select(0, slots) if own_tau else None  # (B, H); else cfg.tau everywhere
        period = state.period.index_select(0, slots) if cfg.refresh_guard else None  # (B, H); else T_r everywhere
        path = gqa_paths(head_paths(max_sim, state.step[slots], cfg, state.phase, tau, period), max_sim,
                         kv.num_kv_heads, cfg, tau)  # (B, H) int8

        reuse = path == Path.REUSE
        n_reuse = int(reuse.sum())
        if n_reuse == B * H:  # the common step, every head reuses: its rows are the results, no scatter
            b = torch.arange(B, device=q.device).repeat_interleave(H)  # (B*H,)
            h = torch.arange(H, device=q.device).repeat(B)  # (B*H,)
            sp, ss, n = self._reuse_select(q.reshape(B * H, d), sim.view(B * H, -1), kv, state, slots, b, h, scale)
            sel_pos, sel_scores, n_scored = sp.view(B, H, -1), ss.view(B, H, -1), n.view(B, H)
        else:
            sel_pos = torch.full((B, H, cfg.top_k), -1, dtype=torch.long, device=q.device)
            sel_scores = torch.full((B, H, cfg.top_k), NEG_INF, dtype=torch.float32, device=q.device)
            n_scored = kv.lengths.to(torch.int32).view(B, 1).expand(B, H).clone()  # exact paths score L
            if n_reuse:
                b, h = reuse.nonzero(as_tuple=True)  # (P,), (P,)
                sel_pos[b, h], sel_scores[b, h], n_scored[b, h] = self._reuse_select(q[b, h], sim[b, h], kv, state,
                                                                                     slots, b, h, scale)
            exact_select(q, kv, cfg.top_k, scale, need=~reuse, sel_pos=sel_pos, sel_scores=sel_scores, ws=self._ws)
            if cfg.tau_calibration or cfg.refresh_guard or cfg.tau_guard:
                self._observe_exact(state, slots, sim, max_sim, path, tau, sel_pos, sel_scores, kv)

        out = sparse_attend(kv, sel_pos, sel_scores, q.dtype, self._ws)  # (B, H, d_v)
        state.push(slots, qn, sel_pos)
        state.step[slots] += 1
        return StepOutput(out=out, path=path, max_sim=max_sim, n_scored=n_scored, selected=sel_pos)

    def _reuse_select(self, q: torch.Tensor, sim: torch.Tensor, kv: PagedKV, state: QuerySupportCache,
                      slots: torch.Tensor, b: torch.Tensor, h: torch.Tensor, scale: float,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reuse path for P (sequence, head) rows: recall, candidates, exact scores, rerank (eq. 7-11).

        q (P, d), sim (P, C), b/h (P,) sequence index into the batch and query head
        ->  Ŝ_t (P, K) int64 -1 padded, its scores (P, K) float32, M_t (P,) int32
        """
        cand = self._candidates(sim, state, slots[b], h, kv.lengths[b])  # (P, M)
        g = kv_heads(state.queries.shape[1], kv.num_kv_heads, q.device)[h]  # (P,)
        scores = indexed_scores(q, kv, b, g, cand, scale, self._ws)  # (P, M)
        sp, ss = topk_select(scores, cand, self.config.top_k)  # (P, K)
        return sp, ss, (cand >= 0).sum(-1).to(torch.int32)

    def _observe_exact(self, state: QuerySupportCache, slots: torch.Tensor, sim: torch.Tensor, max_sim: torch.Tensor,
                       path: torch.Tensor, tau: torch.Tensor | None, sel_pos: torch.Tensor, sel_scores: torch.Tensor,
                       kv: PagedKV) -> None:
        """On the heads that took an exact support this step, the recall that reuse would have had
        (|Ŝ_exact ∩ A_t| / |Ŝ_exact| with A_t the candidates eq. 8-9 would have built: reuse reranks A_t by exact
        scores, so that is its recall; with ``mass_recall`` the share of Ŝ_exact's softmax weight on A_t, weights from
        the exact scores, ``fidelity.mass_recall``) moves each head's tau (``tau_calibration``: every exact head with a
        non-empty FIFO, ``calibrate_tau``) and its refresh period (``refresh_guard``: the REFRESH heads whose
        ρ_max >= tau_h, i.e. that would have reused, ``guard_period``) and, after calibration, raises the tau of
        the exact heads that would have reused and missed (``tau_guard``: refreshed or promoted heads with
        ρ_max >= tau_h, ``guard_tau``). The keys are read already; the extra work is one candidate union per
        observed head. tau (B, H): the thresholds this step decided with."""
        cfg = self.config
        cal = (path != Path.REUSE) & torch.isfinite(max_sim) if cfg.tau_calibration else None  # (B, H)
        would_reuse = max_sim >= (cfg.tau if tau is None else tau)  # (B, H)
        guard = (path == Path.REFRESH) & would_reuse if cfg.refresh_guard else None  # (B, H)
        raise_ = (path != Path.REUSE) & would_reuse if cfg.tau_guard else None  # (B, H)
        seen = torch.zeros_like(would_reuse)
        for m in (cal, guard, raise_):
            seen = seen if m is None else seen | m
        b, h = seen.nonzero(as_tuple=True)  # (P,) each
        if b.numel() == 0:
            return
        cand = self._candidates(sim[b, h], state, slots[b], h, kv.lengths[b])  # (P, M) ascending, -1 padded
        if cfg.mass_recall:  # the exact support's attention weight reuse would have kept
            recall = mass_recall(cand, sel_pos[b, h], sel_scores[b, h])  # (P,)
        else:
            recall = support_recall(cand, sel_pos[b, h])  # (P,)
        rows = slots[b]
        if cal is not None:
            on = cal[b, h]  # (P,)
            new = calibrate_tau(state.tau[rows, h], max_sim[b, h], recall, cfg.tau_calibration, state.tau0)
            state.tau[rows, h] = torch.where(on, new, state.tau[rows, h])
        if guard is not None:
            on = guard[b, h]  # (P,)
            new = guard_period(state.period[rows, h], recall, cfg.refresh_guard, cfg.refresh_every)
            state.period[rows, h] = torch.where(on, new, state.period[rows, h])
        if raise_ is not None:
            on = raise_[b, h]  # (P,)
            new = guard_tau(state.tau[rows, h], max_sim[b, h], recall, cfg.tau_guard, cfg.tau_guard_margin)
            state.tau[rows, h] = torch.where(on, new, state.tau[rows, h])

    def _similarity(self, qn: torch.Tensor, state: QuerySupportCache, slots: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ρ (B, H, C) with -inf at empty entries, and ρ_max (B, H) (eq. 6, 7)."""
        cached = state.queries.index_select(0, slots)  # (B, H, C, d)
        sim = torch.matmul(cached, qn.unsqueeze(-1)).squeeze(-1)  # (B, H, C)
        C = sim.shape[-1]
        empty = torch.arange(C, device=qn.device).view(1, 1, C) >= state.fill[slots].view(-1, 1, 1)  # (B, 1, C)
        sim = sim.masked_fill(empty, NEG_INF)
        return sim, sim.max(dim=-1).values

    def _candidates(self, sim: torch.Tensor, state: QuerySupportCache, slot: torch.Tensor, head: torch.Tensor,
                    length: torch.Tensor) -> torch.Tensor:
        """Sorted unique candidate positions per reuse head, -1 padded (eq. 8, 9).

        sim (P, C) similarities of each reuse head, slot/head/length (P,)  ->  (P, M), M = max M_t
        """
        cfg = self.config
        P, C = sim.shape
        if cfg.retrieval == "similarity":
            r_sim, r_idx = sim.topk(cfg.recall, dim=-1)  # (P, R)
            r_ok = r_sim > NEG_INF
        else:  # ablation: the R most recently inserted entries
            age = torch.arange(1, cfg.recall + 1, device=sim.device).view(1, -1)  # (1, R)
            r_idx = (state.ptr[slot].view(P, 1) - age) % C  # (P, R)
            r_ok = age <= state.fill[slot].view(P, 1)
        H = state.support.shape[1]
        rows = (slot.view(P, 1) * H + head.view(P, 1)) * C + r_idx  # (P, R) rows of support viewed (S*H*C, K)
        supports = state.support.view(-1, cfg.top_k).index_select(0, rows.view(-1)).view(P, -1)  # (P, R*K)
        if not bool(r_ok.all()):  # fewer than R entries cached yet
            supports = supports.masked_fill(~r_ok.repeat_interleave(cfg.top_k, dim=1), -1)
        if cfg.recall_successors:  # each recalled position's successor p + 1 <= L - 1 (the history's last; a support
            # precedes its step, so only a stale FIFO has p = L - 1, whose successor the kernels drop as well)
            ok = (supports >= 0) & (supports + 1 < length.view(P, 1))  # (P, R*K)
            supports = torch.cat([supports, torch.where(ok, supports + 1, -1)], dim=1)  # (P, 2*R*K)
        window = length.view(P, 1) - cfg.window + torch.arange(cfg.window, device=sim.device).view(1, -1)  # (P, W)
        return _unique_rows(torch.cat([supports, window], dim=1), int(length.max()) + 1)  # (P, N + W) -> (P, M)


def _unique_rows(cand: torch.Tensor, span: int) -> torch.Tensor:
    """The distinct positions of each row, sorted and packed to the left, -1 padded.

    cand (P, N) int64 positions in [0, span) or -1  ->  (P, M) int64, M = the largest row count (>= 1).
    Short histories (span <= 4N, e.g. every chat turn of a few hundred tokens): mark the positions in
    a (P, span) bitmap and read it back in order. Long ones: one flat sort of the keys
    row * (span + 1) + pos (padding -> pos = span) orders every row inside its own segment; int32 keys
    when they fit, since the CPU sorts those faster than int64 keys or a batched row sort. Then the first
    occurrence of each position is kept and the kept ones are compacted with a cumsum + scatter.
    """
    P, N = cand.shape
    if span <= 4 * N:
        return _unique_rows_bitmap(cand, span)
    width = span + 1
    dtype = torch.int32 if P * width < 2 ** 31 else torch.long
    rows = torch.arange(P, device=cand.device, dtype=dtype).view(P, 1) * width  # (P, 1)
    key = (torch.where(cand >= 0, cand, span).to(dtype) + rows).view(-1).sort().values.view(P, N)  # (P, N)
    pos = key - rows  # (P, N) sorted positions, span at padding
    keep = pos < span
    keep[:, 1:] &= key[:, 1:] != key[:, :-1]  # first occurrence only
    M = max(int(keep.sum(-1).max()), 1)
    dest = torch.where(keep, keep.cumsum(-1) - 1, M)  # (P, N), dropped entries -> spare column M
    out = pos.new_full((P, M + 1), -1).scatter_(1, dest, pos)
    return out[:, :M].long()


def _unique_rows_bitmap(cand: torch.Tensor, span: int) -> torch.Tensor:
    """``_unique_rows`` through a (P, span + 1) bitmap: O(P * span) work, no sort."""
    P = cand.shape[0]
    seen = torch.zeros(P, span + 1, dtype=torch.bool, device=cand.device)
    seen.scatter_(1, torch.where(cand >= 0, cand, span), True)  # padding marks the spare column span
    seen = seen[:, :span]  # (P, span)
    count = seen.sum(-1)  # (P,)
    M = max(int(count.max()), 1)
    row, pos = seen.nonzero(as_tuple=True)  # row-major: each row's positions ascending
    rank = torch.arange(row.numel(), device=cand.device) - (count.cumsum(0) - count)[row]  # column in the output
    out = torch.full((P, M), -1, dtype=torch.long, device=cand.device)
    out[row, rank] = pos
    return out


def by_position(support: torch.Tensor) -> torch.Tensor:
    """Support rows (..., K) int64 with their positions ascending and the -1 padding after them: the
    order the Triton selector's merge-only path expects (it checks, see kernels/selector.py)."""
    last = torch.iinfo(torch.long).max
    rows = support.masked_fill(support < 0, last).sort(-1).values
    return rows.masked_fill_(rows == last, -1)


def _unit(x: torch.Tensor) -> torch.Tensor:
    """x / ||x||_2 along the last dim, in float32 (zero vectors stay zero)."""
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
