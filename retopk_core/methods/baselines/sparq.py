"""SparQ attention (Ribar et al., 2024): approximate scores from the query's largest components.

Per query head with query q over L cached keys:

    I      = indices of the r largest |q_i|                          (r = d / 8 by default)
    ŝ_j    = q[I] . k_j[I]                      for every position j   approximate scores
    S      = TopK_j ŝ_j                                                 positions kept
    y      = sum_{j in S} softmax_S(q . k_j * scale)_j v_j              exact attention over S

Option ``reallocate`` (SparQ's mean-value reallocation, off by default): with the approximate
weights â = softmax(ŝ / sqrt(d * ||q[I]||_1 / ||q||_1)) and α = sum_{j in S} â_j, the output is
α y + (1 - α) v̄, v̄ the mean of all L values; it returns the mass of the dropped positions to
the mean value.

Kept from the paper: the r-component query selection, Top-K over approximate scores, exact
attention over the Top-K, the softmax temperature correction and mean-value reallocation (as an
option). Deviations: reallocation is off by default so that every method attends exactly the K
selected tokens under the shared budget (turn it on for the paper's SparQ); the original stores K
twice (also transposed) to read only r components per key; this torch reference multiplies a
zero-masked query with the full keys (the same scores, one BLAS call), so its latency does not show
SparQ's bandwidth saving; n_approx counts the algorithm's work. GQA: each query head picks its own
components and positions over its KV head's keys.

Accounting: path APPROX; n_approx = L keys scored approximately (each at r/d of an exact score's
cost); n_scored = tokens attended (scored exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.base import Path, SlotPool, StepOutput
from retopk_core.methods.baselines._common import Baseline, attend_positions, full_path, lengths_bh, step_output
from retopk_core.methods.sparse import resolve_scale, topk_select
from retopk_core.params import MethodConfig, param


@dataclass(frozen=True)
class SparQConfig(MethodConfig):
    top_k: int = param(512, "tokens attended per head and step", low=1, context=True)
    r: int | None = param(None, "query components used (None = head_dim // 8, at least 1)", low=1)
    reallocate: bool = param(False, "SparQ's mean-value reallocation of the dropped attention mass")

    def components(self, head_dim: int) -> int:
        return min(head_dim, self.r if self.r is not None else max(1, head_dim // 8))


class SparQ(Baseline):
    name = "sparq"
    config_class = SparQConfig

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        K, r = self.config.top_k, self.config.components(d)
        G = H // kv.num_kv_heads
        sel = torch.full((B, H, K), -1, dtype=torch.long, device=q.device)
        alpha = torch.ones(B, H, device=q.device)  # kept approximate mass (reallocation)
        v_mean = torch.zeros(B, H, kv.v_pool.shape[-1], device=q.device)
        for b in range(B):  # Python loop over (sequence, KV group), like the exact path
            L = int(kv.lengths[b])
            for g in range(kv.num_kv_heads):
                heads = slice(g * G, (g + 1) * G)
                qg = q[b, heads].float()  # (G, d)
                comp = qg.abs().topk(r, dim=-1).indices  # (G, r) the r largest |q_i|
                keys = kv.keys(b, g, L).float()  # (L, d)
                q_sparse = torch.zeros_like(qg).scatter_(1, comp, qg.gather(1, comp))  # (G, d) q[I], 0 elsewhere
                approx = q_sparse @ keys.T  # (G, L) ŝ = q[I] . k_j[I] (the zeros add nothing)
                pos = torch.arange(L, device=q.device).expand(G, L)
                sp, _ = topk_select(approx, pos, K)  # (G, K)
                sel[b, heads] = sp
                if self.config.reallocate:
                    l1 = qg.gather(1, comp).abs().sum(-1) / qg.abs().sum(-1).clamp_min(1e-30)  # (G,)
                    temp = torch.sqrt(d * l1).clamp_min(1e-30).unsqueeze(-1)  # (G, 1)
                    w = torch.softmax(approx / temp, dim=-1)  # (G, L) â
                    alpha[b, heads] = w.gather(1, sp.clamp(min=0)).masked_fill(sp < 0, 0).sum(-1)
                    v_mean[b, heads] = kv.values(b, g, L).float().mean(0)
        out, n_valid = attend_positions(q, kv, sel, scale)  # (B, H, d_v), (B, H)
        if self.config.reallocate:
            out = (alpha.unsqueeze(-1) * out.float() + (1 - alpha).unsqueeze(-1) * v_mean).to(q.dtype)
        return step_output(out, full_path(B, H, Path.APPROX, q.device), n_valid, sel, lengths_bh(kv, H))

    def describe(self) -> dict:
        described = super().describe()
        if self.config.r is None:
            described["r"] = "head_dim/8"
        return described

