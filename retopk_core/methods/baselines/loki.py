"""Loki (Singhania et al., 2024): approximate scores in a low-rank PCA space of the keys.

At a sequence's first prefill, per KV head, the prompt's keys k_1..k_L give the mean μ and the
covariance Σ = (1/L) Σ_j (k_j - μ)(k_j - μ)^T; the basis P_r (d, r) holds its r leading
eigenvectors. Every key is projected once, k̃_j = P_r^T k_j (kept in the state as tokens are
appended), and a decode step for query q does

    ŝ_j = (P_r^T q) . k̃_j         for every position j         approximate scores (r of d dims)
    S   = TopK_j ŝ_j                                              positions kept
    y   = sum_{j in S} softmax_S(q . k_j * scale)_j v_j           exact attention over S

Kept from the paper: PCA of the keys per layer and KV head, scores in the rank-r space, Top-K,
exact attention over the Top-K with the full keys. Deviations: (1) Loki computes the basis offline
on a calibration set; here (as the ReTopK comparison specifies) it comes from the prompt's own keys
at the first prefill and stays fixed afterwards (later turns and decode tokens are projected on
it); (2) the PCA is of the keys the cache holds, i.e. after RoPE (Loki studies both pre- and
post-rotary keys); (3) the original rotates the stored keys in place; here the rank-r projections
are kept beside the cache in float32 (r * 4 bytes per token and KV head). A rank r >= d is the
identity basis (exact scores). If ``decode`` meets a slot that never saw ``prefill`` it builds the
basis from the keys present at that step.

Accounting: path APPROX; n_approx = L keys scored approximately (each at r/d of an exact score's
cost); n_scored = tokens attended (scored exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import state_bounds
from retopk_core.methods.base import Path, SlotPool, StepOutput
from retopk_core.methods.baselines._common import (
    KeyTracking,
    attend_positions,
    full_path,
    lengths_bh,
    new_keys,
    step_output,
)
from retopk_core.methods.sparse import NEG_INF, kv_heads, resolve_scale, topk_select
from retopk_core.params import MethodConfig, param


@dataclass(frozen=True)
class LokiConfig(MethodConfig):
    top_k: int = param(512, "tokens attended per head and step", low=1, context=True)
    rank: int = param(64, "PCA components r (clamped to head_dim)", low=1)


def pca_basis(keys: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading principal directions of keys (L, d) -> (d, rank) float32, orthonormal."""
    d = keys.shape[-1]
    if rank >= d:
        return torch.eye(d, device=keys.device)
    x = keys.float() - keys.float().mean(0, keepdim=True)  # (L, d) centred
    cov = x.T @ x / max(1, x.shape[0])  # (d, d)
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues
    return vecs[:, -rank:].flip(-1).contiguous()  # (d, rank) largest first


class LokiState(SlotPool):
    """Per-sequence PCA basis and projected keys of one layer.

    basis     (S, H_kv, d, r) float32    P_r per KV head, fixed at the first prefill
    has_basis (S,) bool
    proj      (S, H_kv, T, r) float32    k̃_j = P_r^T k_j for positions j < n_tokens (T grows by doubling)
    n_tokens  (S,) int64                 positions already projected
    """

    _fields = ("basis", "has_basis", "proj", "n_tokens")
    _growing = {"proj": 1}  # tokens

    def __init__(self, num_kv_heads: int, head_dim: int, rank: int, device: torch.device | str = "cpu",
                 capacity: int = 1, tokens: int = 64) -> None:
        super().__init__(capacity)
        r = min(rank, head_dim)
        self.rank = r
        self.basis = torch.zeros(self.capacity, num_kv_heads, head_dim, r, device=device)
        self.has_basis = torch.zeros(self.capacity, dtype=torch.bool, device=device)
        self.proj = torch.zeros(self.capacity, num_kv_heads, tokens, r, device=device)
        self.n_tokens = torch.zeros(self.capacity, dtype=torch.long, device=device)

    def used_extent(self, slot: int) -> int:
        return int(self.n_tokens[slot])

    def ensure_extent(self, n: int) -> None:
        self._ensure_tokens(n)

    def _ensure_tokens(self, n: int) -> None:
        old = self.proj.shape[2]
        if n <= old:
            return
        S, H_kv, _, r = self.proj.shape
        proj = self.proj.new_zeros((S, H_kv, max(n, 2 * old), r))
        proj[:, :, :old] = self.proj
        self.proj = proj

    def update(self, slots: torch.Tensor, kv: PagedKV) -> None:
        """Build missing bases from each sequence's current keys, then project positions
        n_tokens[slot] .. L_b - 1. slots (B,) int64; kv holds the same B sequences."""
        L = kv.lengths.to(slots.device)  # (B,)
        for b in (~self.has_basis[slots]).nonzero().flatten().tolist():  # once per sequence
            for g in range(kv.num_kv_heads):
                self.basis[slots[b], g] = pca_basis(kv.keys(b, g, int(L[b])), self.rank)
            self.has_basis[slots[b]] = True
        new = new_keys(self.n_tokens, slots, kv)
        if new is None:
            return
        pos, keys = new  # (B, M), (B, H_kv, M, d)
        self._ensure_tokens(int(L.max()))
        B, M = pos.shape
        g = torch.arange(kv.num_kv_heads, device=slots.device).view(1, -1, 1)
        proj = keys.float() @ self.basis[slots]  # (B, H_kv, M, d) @ (B, H_kv, d, r) -> (B, H_kv, M, r)
        self.proj[slots.view(B, 1, 1), g, pos.view(B, 1, M)] = proj
        self.n_tokens[slots] = L


class Loki(KeyTracking):  # prefill: the first one builds the basis from the prompt's keys, each projects them
    name = "loki"
    config_class = LokiConfig

    def init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                   capacity: int = 1) -> LokiState:
        return LokiState(num_kv_heads, head_dim, self.config.rank, device, capacity)

    def check_state(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """n_tokens in [0, length] and the same in every layer, the projections as many tokens as it counts (the
        pool grows to them), the basis finite."""
        state_bounds.require(tensors, LokiState.field_names())
        state_bounds.integers_within(tensors, "n_tokens", 0, length, "the session's tokens")
        n = tensors["n_tokens"]
        if n.numel() and bool((n != n.flatten()[0]).any()):
            raise ValueError("method state: n_tokens must be the same in every layer")
        state_bounds.extent(tensors, "proj", 2, int(n.flatten()[0]) if n.numel() else 0, "tokens (n_tokens)")
        state_bounds.flags(tensors, "has_basis")
        state_bounds.finite(tensors, "basis", "proj")

    def decode(self, q: torch.Tensor, kv: PagedKV, state: LokiState, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        state.update(slots, kv)  # project the current token's key
        H_kv = kv.num_kv_heads
        kv_heads(H, H_kv)  # raises unless H is a multiple of H_kv
        G = H // H_kv  # query heads g*G .. (g+1)*G - 1 read KV head g
        L = kv.lengths.to(q.device)  # (B,)
        L_max = int(L.max())
        pos = torch.arange(L_max, device=q.device)
        approx = torch.full((B, H, L_max), NEG_INF, device=q.device)  # ŝ, -inf past each length
        for b in range(B):  # views of one slot's projected keys (no copy)
            s, Lb = int(slots[b]), int(L[b])
            q_r = q[b].float().view(H_kv, G, d) @ state.basis[s]  # (H_kv, G, r) = P_r^T q
            approx[b, :, :Lb] = (q_r @ state.proj[s, :, :Lb].transpose(-1, -2)).reshape(H, Lb)  # (H, Lb)
        sel, _ = topk_select(approx.view(B * H, L_max), pos.expand(B * H, L_max), self.config.top_k)
        sel = sel.view(B, H, -1)  # (B, H, K)
        out, n_valid = attend_positions(q, kv, sel, scale)  # (B, H, d_v), (B, H)
        return step_output(out, full_path(B, H, Path.APPROX, q.device), n_valid, sel, lengths_bh(kv, H))
