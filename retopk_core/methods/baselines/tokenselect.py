"""TokenSelect (Wu et al., 2025): token-level selection by head soft voting, with a selection cache.

For a sequence of length L (current token included) with I initial and W local tokens, the
middle range is M = [I, max(I, L - W)). A selection step with queries q_h of all H heads:

    p_h  = softmax_j(q_h . k_{g(h), j} * scale)   over all L positions, per head  (per-head softmax)
    v_j  = sum_h p_h,j                                                            (soft vote)
    S    = Top-N_j∈M v_j                           N = top_k - I - W selected tokens
    A_t  = {0..I-1} ∪ S ∪ {L-W..L-1}   attended by every head of the layer (exact softmax)

Selection cache: with Q_t the concatenation of all heads' queries, if cos(Q_t, Q_{t-1}) >= threshold
(0.9) the previous step's S is reused (path CACHED) instead of re-voting; the initial and local
ranges are always current. Tokens that left the local window since S was chosen are added to S
while it has fewer than N entries, so a sequence whose middle range fits in N is attended in full
on every path. A prefill (new prompt or turn) clears the cache.

Kept from the paper: soft voting across the heads of a layer, one token-level selection shared by
the heads, the 64 initial + 416 selected + 32 local split of the 512 budget, the consecutive-query
cosine cache with threshold 0.9. Deviations: the cosine is taken over the concatenated queries of
all heads of the layer (one decision per layer and sequence); the refill of S on a cache hit
described above; scores here are computed in plain torch, not TokenSelect's paged kernels.

Accounting: on a vote step path APPROX and n_scored = L (every head scores every key exactly to
vote); on a cache hit path CACHED and n_scored = |A_t|; n_approx = 0 (no approximate scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import state_bounds
from retopk_core.methods.base import Path, SlotPool, StepOutput
from retopk_core.methods.baselines._common import Baseline, attend_positions, step_output
from retopk_core.methods.sparse import kv_heads, resolve_scale, topk_select
from retopk_core.params import MethodConfig, ParamError, param


@dataclass(frozen=True)
class TokenSelectConfig(MethodConfig):
    top_k: int = param(512, "tokens attended (initial + selected + local)", low=1, context=True)
    initial: int = param(64, "initial tokens always attended", low=0)
    local: int = param(32, "most recent tokens always attended", low=1)
    threshold: float = param(0.9, "cosine of consecutive queries at or above which the previous selection is "
                                  "reused", low=-1.0, high=1.0)

    def validate(self) -> None:
        if self.initial + self.local > self.top_k:
            raise ParamError("initial", f"initial + local must be <= top_k ({self.top_k}), "
                                        f"got {self.initial + self.local}")

    @property
    def selected(self) -> int:
        return self.top_k - self.initial - self.local


class TokenSelectCache(SlotPool):
    """Per-sequence selection cache of one layer.

    prev_q   (S, H, d) float32   the previous decode step's queries
    sel      (S, N) int64        the current selection S from the middle range, -1 padded
    mid_end  (S,) int64          end of the middle range when ``sel`` was last extended
    has_prev (S,) bool           prev_q and sel are valid (False after alloc and prefill)
    """

    _fields = ("prev_q", "sel", "mid_end", "has_prev")

    def __init__(self, num_heads: int, head_dim: int, selected: int, device: torch.device | str = "cpu",
                 capacity: int = 1) -> None:
        super().__init__(capacity)
        self.prev_q = torch.zeros(self.capacity, num_heads, head_dim, device=device)
        self.sel = torch.full((self.capacity, selected), -1, dtype=torch.long, device=device)
        self.mid_end = torch.zeros(self.capacity, dtype=torch.long, device=device)
        self.has_prev = torch.zeros(self.capacity, dtype=torch.bool, device=device)

    def reset_slot(self, slot: int) -> None:
        super().reset_slot(slot)
        self.sel[slot] = -1


class TokenSelect(Baseline):
    name = "tokenselect"
    config_class = TokenSelectConfig

    def init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                   capacity: int = 1) -> TokenSelectCache:
        return TokenSelectCache(num_heads, head_dim, self.config.selected, device, capacity)

    def prefill(self, state: TokenSelectCache, slot: int, q: torch.Tensor | None, positions: torch.Tensor | None,
                kv: PagedKV, scale: float | None = None) -> None:
        """New tokens arrived outside decode: the cached selection no longer covers them."""
        state.has_prev[slot] = False

    def check_state(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """The selection holds positions in [-1, length) (attention gathers keys at them), mid_end lies in
        [0, length], the previous queries are finite."""
        state_bounds.require(tensors, TokenSelectCache.field_names())
        state_bounds.integers_within(tensors, "sel", -1, length - 1, "positions of the session's tokens")
        state_bounds.integers_within(tensors, "mid_end", 0, length, "the session's tokens")
        state_bounds.flags(tensors, "has_prev")
        state_bounds.finite(tensors, "prev_q")

    def decode(self, q: torch.Tensor, kv: PagedKV, state: TokenSelectCache, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        cfg = self.config
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        G = H // kv.num_kv_heads
        kv_heads(H, kv.num_kv_heads)  # raises unless H is a multiple of H_kv
        n_init, W, N = cfg.initial, cfg.local, cfg.selected
        L = kv.lengths.to(q.device)  # (B,)
        mid_end = torch.maximum(L - W, torch.full_like(L, n_init))  # (B,) middle range [n_init, mid_end)

        qf = q.float().reshape(B, H * d)  # (B, H*d) one query vector per layer and sequence
        prev = state.prev_q[slots].reshape(B, H * d)
        cos = torch.nn.functional.cosine_similarity(qf, prev, dim=-1)  # (B,)
        hit = state.has_prev[slots] & (cos >= cfg.threshold)  # (B,)

        sel = state.sel[slots].clone()  # (B, N)
        for b in range(B):  # per sequence: one vote (or one refill) shared by all heads
            Lb, end = int(L[b]), int(mid_end[b])
            if bool(hit[b]):
                sel[b] = self._refill(sel[b], int(state.mid_end[slots[b]]), end)
                continue
            vote = torch.zeros(Lb, device=q.device)
            for g in range(kv.num_kv_heads):
                keys = kv.keys(b, g, Lb).float()  # (Lb, d)
                vote += torch.softmax((q[b, g * G:(g + 1) * G].float() @ keys.T) * scale, dim=-1).sum(0)
            mid = torch.arange(n_init, end, device=q.device)  # (n_mid,)
            if N and len(mid):
                sel[b], _ = topk_select(vote[n_init:end].unsqueeze(0), mid.unsqueeze(0), N)
            else:
                sel[b] = -1

        state.sel[slots] = sel
        state.mid_end[slots] = mid_end
        state.prev_q[slots] = q.float()
        state.has_prev[slots] = True

        init = torch.arange(n_init, device=q.device).view(1, n_init).expand(B, n_init)
        init = init.masked_fill(init >= L.view(B, 1), -1)  # (B, n_init)
        local = mid_end.view(B, 1) + torch.arange(W, device=q.device).view(1, W)
        local = local.masked_fill(local >= L.view(B, 1), -1)  # (B, W) [mid_end, L)
        pos = torch.cat([init, sel, local], dim=1).unsqueeze(1).expand(B, H, -1).contiguous()  # (B, H, K)
        out, n_valid = attend_positions(q, kv, pos, scale)  # (B, H, d_v), (B, H)
        n_scored = torch.where(hit.view(B, 1), n_valid, L.to(torch.int32).view(B, 1))  # vote scored all L
        path = torch.where(hit, int(Path.CACHED), int(Path.APPROX)).to(torch.int8).view(B, 1).expand(B, H)
        return step_output(out, path, n_scored, pos)

    @staticmethod
    def _refill(sel: torch.Tensor, old_end: int, new_end: int) -> torch.Tensor:
        """Append middle positions old_end .. new_end - 1 (they left the local window) while sel has room."""
        room = int((sel < 0).sum())
        add = torch.arange(old_end, new_end, device=sel.device)[:room]
        if len(add):
            keep = sel[sel >= 0]
            sel = torch.cat([keep, add, sel.new_full((len(sel) - len(keep) - len(add),), -1)])
        return sel

    def describe(self) -> dict:
        return {**super().describe(), "selected": self.config.selected}
