"""Fidelity of a sparse support against exact attention (the paper's figure 6).

For one (sequence, head) with full-softmax probabilities p_i = softmax_j(q . k_j * scale)_i:

    support recall   |Ŝ ∩ S| / |S|          S = Exact Top-K support, Ŝ = the method's support
    retained mass    Σ_{i ∈ Ŝ} p_i           share of the full-softmax probability Ŝ holds
    output cosine    cos(ô, o)               ô = method's output, o = full-attention output
"""

from __future__ import annotations

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.sparse import kv_heads, resolve_scale


def support_recall(selected: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """selected, exact: (..., K) int64, -1 padded  ->  (...) float32 share of exact's positions kept."""
    valid_exact = exact >= 0  # (..., K)
    hit = (exact.unsqueeze(-1) == selected.unsqueeze(-2)) & (selected.unsqueeze(-2) >= 0)  # (..., K, K)
    found = hit.any(-1) & valid_exact  # (..., K)
    return found.sum(-1).float() / valid_exact.sum(-1).clamp_min(1).float()


def mass_recall(selected: torch.Tensor, exact: torch.Tensor, exact_scores: torch.Tensor) -> torch.Tensor:
    """The attention mass of an exact support that ``selected`` keeps:

        Σ_{i ∈ S ∩ Ŝ} w_i,   w = softmax over S of the exact scores (the weights sparse attention gives S)

    selected (..., M), exact (..., K) int64, -1 padded; exact_scores (..., K) float  ->  (...) float32 in [0, 1]
    (1 for an empty S). ``support_recall`` counts each missed position alike; this counts it by its weight."""
    valid_exact = exact >= 0  # (..., K)
    hit = (exact.unsqueeze(-1) == selected.unsqueeze(-2)) & (selected.unsqueeze(-2) >= 0)  # (..., K, M)
    found = hit.any(-1) & valid_exact  # (..., K)
    w = torch.softmax(exact_scores.float().masked_fill(~valid_exact, float("-inf")), dim=-1).nan_to_num(0.0)
    kept = (w * found).sum(-1)
    return torch.where(valid_exact.any(-1), kept, torch.ones_like(kept))


def full_probabilities(q: torch.Tensor, kv: PagedKV, scale: float | None = None) -> torch.Tensor:
    """Full-softmax probabilities over every position: q (B, H, d) -> (B, H, L_max), 0 past lengths."""
    B, H, d = q.shape
    scale = resolve_scale(scale, d)
    k, _ = kv.dense()  # (B, H_kv, L_max, d)
    k = k[:, kv_heads(H, kv.num_kv_heads, q.device)]  # (B, H, L_max, d)
    scores = torch.matmul(k.float(), q.float().unsqueeze(-1)).squeeze(-1) * scale  # (B, H, L_max)
    pad = torch.arange(k.shape[2], device=q.device).view(1, 1, -1) >= kv.lengths.view(B, 1, 1)
    return torch.softmax(scores.masked_fill(pad, float("-inf")), dim=-1)


def retained_mass(probs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """probs (B, H, L) full-softmax probabilities, selected (B, H, K) -1 padded -> (B, H) float32."""
    taken = probs.gather(-1, selected.clamp(min=0)) * (selected >= 0)  # (B, H, K)
    return taken.sum(-1)


def output_cosine(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of head outputs: (B, H, d_v) x (B, H, d_v) -> (B, H) float32."""
    return torch.nn.functional.cosine_similarity(out.float(), reference.float(), dim=-1)
