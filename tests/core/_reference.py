"""A deliberately simple per-head ReTopK, written from the paper's equations 1-13 with Python lists.

It shares no code with retopk_core: one (sequence, query head) at a time, sets for supports, a
plain list as the FIFO. Tests run it beside the batched implementation and compare.
"""

from __future__ import annotations

import math

import torch

REUSE, FALLBACK, REFRESH = 0, 1, 2


def topk_positions(scores: dict[int, float], k: int) -> list[int]:
    """The k positions with the largest scores (eq. 1 / eq. 11)."""
    return sorted(scores, key=lambda i: scores[i], reverse=True)[:k]


class RefHead:
    """One query head of one sequence: its FIFO of (unit query, support) and the step counter."""

    def __init__(self, C: int, K: int, W: int, R: int, tau: float, T_r: int, retrieval: str = "similarity"):
        self.C, self.K, self.W, self.R, self.tau, self.T_r, self.retrieval = C, K, W, R, tau, T_r, retrieval
        self.fifo: list[tuple[torch.Tensor, list[int]]] = []
        self.t_dec = 0

    def _push(self, q: torch.Tensor, support: list[int]) -> None:
        self.fifo.append((q / q.norm(), support))
        if len(self.fifo) > self.C:
            self.fifo.pop(0)

    def prefill(self, queries: torch.Tensor, positions: list[int], keys: torch.Tensor, scale: float) -> None:
        """queries (T, d) at absolute positions; each gets its exact causal Top-K support."""
        for q, p in list(zip(queries, positions, strict=True))[-self.C:]:
            scores = {i: float(q.double() @ keys[i].double()) * scale for i in range(p + 1)}
            self._push(q.double(), topk_positions(scores, self.K))

    def step(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float):
        """One decode step over keys/values (L, d) (the current token included).

        Returns (path, max_sim, candidates, support, output).
        """
        q = q.double()
        L = keys.shape[0]
        qbar = q / q.norm()
        sims = [float(qbar @ qc) for qc, _ in self.fifo]  # eq. 6
        max_sim = max(sims) if sims else -math.inf  # eq. 7
        if self.T_r > 0 and self.t_dec > 0 and self.t_dec % self.T_r == 0:  # eq. 13
            path = REFRESH
        elif max_sim < self.tau:
            path = FALLBACK
        else:
            path = REUSE
        if path == REUSE:
            if self.retrieval == "similarity":
                recalled = sorted(range(len(sims)), key=lambda c: sims[c], reverse=True)[: self.R]
            else:
                recalled = list(range(len(self.fifo)))[-self.R:]
            cand = set(range(max(0, L - self.W), L))  # eq. 8
            for c in recalled:
                cand |= set(self.fifo[c][1])  # eq. 9
        else:
            cand = set(range(L))
        scores = {i: float(q @ keys[i].double()) * scale for i in cand}  # eq. 10 / eq. 4
        support = topk_positions(scores, self.K)  # eq. 11 / eq. 1
        m = max(scores[i] for i in support)
        w = torch.tensor([math.exp(scores[i] - m) for i in support], dtype=torch.float64)
        out = (w / w.sum()) @ values[support].double()  # eq. 12
        self._push(q, support)
        self.t_dec += 1
        return path, max_sim, sorted(cand), support, out
