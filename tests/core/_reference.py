"""A deliberately simple per-head ReTopK, written from the paper's equations 1-13 with Python lists.

It shares no code with retopk_core: one (sequence, query head) at a time, sets for supports, a
plain list as the FIFO. Tests run it beside the batched implementation and compare.
"""

from __future__ import annotations

import math

import torch

REUSE, FALLBACK, REFRESH, PROMOTED = 0, 1, 2, 7


def topk_positions(scores: dict[int, float], k: int) -> list[int]:
    """The k positions with the largest scores (eq. 1 / eq. 11)."""
    return sorted(scores, key=lambda i: scores[i], reverse=True)[:k]


class RefHead:
    """One query head of one sequence: its FIFO of (unit query, support) and the step counter."""

    def __init__(self, C: int, K: int, W: int, R: int, tau: float, T_r: int, retrieval: str = "similarity",
                 phase: int = 0, calibration: float = 0.0, guard: float = 0.0, mass: bool = False,
                 tau_guard: float = 0.0, tau_guard_margin: float = 0.05, successors: bool = False, first: int = 0):
        self.C, self.K, self.W, self.R, self.tau, self.T_r, self.retrieval = C, K, W, R, tau, T_r, retrieval
        self.tau0, self.calibration = tau, calibration  # tau_calibration: this head's tau moves (calibrate)
        self.phase = phase  # staggered refresh: this head refreshes when (t_dec + phase) % period == 0
        # refresh_guard: this head's refresh period starts at T_r / 8 (at least 1) and moves (guard_step)
        self.guard, self.period = guard, (max(1, T_r // 8) if guard else T_r)
        self.mass = mass  # mass_recall: both rules measure the support's softmax weight reuse keeps, not its count
        self.tau_guard = tau_guard  # tau_guard: a miss where the head would have reused raises its tau (raise_tau)
        self.tau_guard_margin = tau_guard_margin  # ... to max_sim + this margin
        self.successors = successors  # recall_successors: A_t also holds p + 1 for each recalled position p
        self.first = first  # refresh_first: each prefill owes this many exact (REFRESH) steps, the turn's onset
        self.onset = 0  # onset steps still owed
        self.fifo: list[tuple[torch.Tensor, list[int]]] = []
        self.t_dec = 0

    def _reuse_candidates(self, sims: list[float], L: int) -> set[int]:
        """A_t of eq. 8-9: the recalled entries' supports and the recent window."""
        if self.retrieval == "similarity":
            recalled = sorted(range(len(sims)), key=lambda c: sims[c], reverse=True)[: self.R]
        else:
            recalled = list(range(len(self.fifo)))[-self.R:]
        cand = set(range(max(0, L - self.W), L))  # eq. 8
        for c in recalled:
            cand |= set(self.fifo[c][1])  # eq. 9
            if self.successors:
                cand |= {p + 1 for p in self.fifo[c][1] if p + 1 < L}
        return cand

    def calibrate(self, max_sim: float, recall: float) -> None:
        """tau_calibration's rule, written out: an observation within 0.05 of tau moves it by
        0.1 x (target - recall); tau stays within [tau0 - 0.35, tau0], or below its own value when tau_guard
        raised it above tau0."""
        if abs(max_sim - self.tau) < 0.05:
            ceiling = max(self.tau0, self.tau)
            self.tau = min(ceiling, max(self.tau0 - 0.35, self.tau + 0.1 * (self.calibration - recall)))

    def raise_tau(self, max_sim: float, recall: float) -> None:
        """tau_guard's rule, written out, on an exact step where the head would have reused: a recall under the
        target raises tau to max_sim + its margin (at most 1), never lowering it."""
        if recall < self.tau_guard:
            self.tau = max(self.tau, min(1.0, max_sim + self.tau_guard_margin))

    def guard_step(self, recall: float) -> None:
        """refresh_guard's rule, written out, on a refresh where the head would have reused: a recall under
        the target halves the period (to T_r / 8 at least), one at least 0.1 above it (or half the way to 1,
        when that is less) doubles it (to T_r)."""
        if recall < self.guard:
            self.period = max(self.period // 2, max(1, self.T_r // 8))
        elif recall >= self.guard + min(0.1, (1 - self.guard) / 2):
            self.period = min(self.period * 2, self.T_r)

    def _push(self, q: torch.Tensor, support: list[int]) -> None:
        self.fifo.append((q / q.norm(), support))
        if len(self.fifo) > self.C:
            self.fifo.pop(0)

    def prefill(self, queries: torch.Tensor, positions: list[int], keys: torch.Tensor, scale: float) -> None:
        """queries (T, d) at absolute positions; each gets its exact causal Top-K support. With ``first`` the
        turn's onset begins: ``first`` refreshes, then the schedule's clock restarts at t_dec = 0."""
        if self.first:
            self.onset, self.t_dec = self.first, 0
        for q, p in list(zip(queries, positions, strict=True))[-self.C:]:
            scores = {i: float(q.double() @ keys[i].double()) * scale for i in range(p + 1)}
            self._push(q.double(), topk_positions(scores, self.K))

    def decide(self, q: torch.Tensor) -> tuple[int, float]:
        """This head's own decision for query q (eq. 13): (path, max_sim)."""
        q = q.double()
        qbar = q / q.norm()
        sims = [float(qbar @ qc) for qc, _ in self.fifo]  # eq. 6
        max_sim = max(sims) if sims else -math.inf  # eq. 7
        if self.onset:
            return REFRESH, max_sim
        if self.T_r > 0 and self.t_dec > 0 and (self.t_dec + self.phase) % self.period == 0:  # eq. 13
            return REFRESH, max_sim
        return (FALLBACK if max_sim < self.tau else REUSE), max_sim

    def plain_step(self) -> None:
        """A dense-floor step more than C steps below the floor: it selects and pushes nothing, but counts."""
        self._count()

    def _count(self) -> None:
        """A step taken: one onset step fewer, else the schedule's clock on."""
        if self.onset:
            self.onset -= 1
        else:
            self.t_dec += 1

    def step(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, path: int | None = None):
        """One decode step over keys/values (L, d) (the current token included); ``path`` overrides the
        head's own decision (a GQA policy's verdict for its group).

        Returns (path, max_sim, candidates, support, output).
        """
        own, max_sim = self.decide(q)
        path = own if path is None else path
        q = q.double()
        L = keys.shape[0]
        qbar = q / q.norm()
        sims = [float(qbar @ qc) for qc, _ in self.fifo]
        reuse_cand = self._reuse_candidates(sims, L)
        cand = reuse_cand if path == REUSE else set(range(L))
        scores = {i: float(q @ keys[i].double()) * scale for i in cand}  # eq. 10 / eq. 4
        support = topk_positions(scores, self.K)  # eq. 11 / eq. 1
        recall = len(set(support) & reuse_cand) / len(support) if support else 1.0
        if self.mass and support:  # the exact support's weights (eq. 12's softmax), summed over what reuse finds
            top = max(scores[i] for i in support)
            weight = {i: math.exp(scores[i] - top) for i in support}
            recall = sum(weight[i] for i in support if i in reuse_cand) / sum(weight.values())
        would_reuse = max_sim >= self.tau  # the threshold this step decided with (before calibrate moves it)
        if self.calibration and path != REUSE and sims:
            self.calibrate(max_sim, recall)
        if self.guard and path == REFRESH and sims and would_reuse:
            self.guard_step(recall)
        if self.tau_guard and path != REUSE and sims and would_reuse:
            self.raise_tau(max_sim, recall)
        m = max(scores[i] for i in support)
        w = torch.tensor([math.exp(scores[i] - m) for i in support], dtype=torch.float64)
        out = (w / w.sum()) @ values[support].double()  # eq. 12
        self._push(q, support)
        self._count()
        return path, max_sim, sorted(cand), support, out


def stagger_phase(layer: int, group: int, num_kv_heads: int, T_r: int) -> int:
    """Refresh phase of (layer, KV group) under refresh_stagger: floor(v(u) * T_r), u = layer * H_kv + group,
    v(u) = sum_i bit_i(u) / 2^(i+1) (the van der Corput sequence), summed here bit by bit in floats."""
    u, v, f = layer * num_kv_heads + group, 0.0, 0.5
    while u:
        v += f * (u % 2)
        u, f = u // 2, f / 2
    return math.floor(v * T_r)


def group_paths(heads: list[RefHead], queries: list[torch.Tensor], policy: str, tau_min: float = 0.0) -> list[int]:
    """The paths a GQA policy gives the heads of one KV group, from each head's own decision.

    head: each its own. promote: a group with any head falling back sends every head to an exact path.
    group: the group is read when its heads' mean max_sim < tau or their lowest < tau_min. In a read
    group a head below tau falls back and the others are PROMOTED; in an unread group all reuse.
    A refreshing head keeps REFRESH (every head of a sequence at once, unless refresh_guard gave the heads
    their own periods).
    """
    own = [h.decide(q) for h, q in zip(heads, queries, strict=True)]
    if policy == "head" or all(p == REFRESH for p, _ in own):
        return [p for p, _ in own]
    sims = [m for _, m in own]
    if policy == "promote":
        read = any(p == FALLBACK for p, _ in own)
    elif policy == "group":
        read = sum(sims) / len(sims) < sum(h.tau for h in heads) / len(heads) or min(sims) < tau_min
    else:
        raise ValueError(policy)
    if not read:
        return [REFRESH if p == REFRESH else REUSE for p, _ in own]
    return [p if p in (REFRESH, FALLBACK) else PROMOTED for p, _ in own]
