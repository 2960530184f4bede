"""Quest (Tang et al., 2024): query-aware page selection from per-page key bounds.

The KV history of each sequence is cut into logical pages of P tokens (positions pP .. pP+P-1,
independent of the PagedKV block size). Per page and KV head the state keeps the element-wise
minimum m_p and maximum M_p of its keys, updated as tokens are appended (prefill and every decode
step). For query q (of a head reading that KV head) the page's upper bound on q . k is

    U_p = sum_i max(q_i * m_p,i, q_i * M_p,i)  =  relu(q) . M_p - relu(-q) . m_p

Pages are ranked by U_p and the longest ranked prefix whose token count (P per page, fewer for the
last, partial page) fits the token budget top_k is attended with exact softmax attention.

Kept from the paper: page size 16, min/max metadata maintained on append, the bound U_p, Top pages
within a token budget, exact attention over the chosen pages' tokens.
Deviations: (1) the budget is counted in valid tokens, so a partial last page costs only its
tokens and a budget >= L selects every page (the paper budgets whole pages); (2) Quest leaves the
first two layers dense; choosing a method per layer is the integration's business, not this
class's; (3) GQA: the original targets MHA models; here page bounds are kept once per KV head and
every query head ranks them with its own query (no sharing of the selection across the group).

Accounting: path APPROX; n_approx = pages whose bound was computed (ceil(L / P); one bound costs
2d multiply-adds, i.e. about two keys' worth of work); n_scored = tokens attended (scored exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import state_bounds
from retopk_core.methods.base import Path, SlotPool, StepOutput
from retopk_core.methods.baselines._common import KeyTracking, attend_positions, full_path, new_keys, step_output
from retopk_core.methods.sparse import NEG_INF, kv_heads, resolve_scale
from retopk_core.params import MethodConfig, ParamError, param

_INF = float("inf")


@dataclass(frozen=True)
class QuestConfig(MethodConfig):
    top_k: int = param(512, "token budget per head and step", low=1, context=True)
    page_size: int = param(16, "tokens per page (P, <= top_k)", low=1)

    def validate(self) -> None:
        if self.page_size > self.top_k:
            raise ParamError("page_size", f"page_size must be <= top_k ({self.top_k}) so one full page fits, "
                                          f"got {self.page_size}")


class QuestPageState(SlotPool):
    """Per-sequence page bounds of one layer.

    kmin     (S, H_kv, N_p, d) float32  element-wise key minimum per page, +inf on empty pages
    kmax     (S, H_kv, N_p, d) float32  element-wise key maximum per page, -inf on empty pages
    n_tokens (S,) int64                 positions already folded into the bounds
    N_p (pages per slot) grows by doubling as sequences grow, like the slot dimension.
    """

    _fields = ("kmin", "kmax", "n_tokens")
    _growing = {"kmin": 1, "kmax": 1}  # pages

    def __init__(self, num_kv_heads: int, head_dim: int, page_size: int, device: torch.device | str = "cpu",
                 capacity: int = 1, pages: int = 4) -> None:
        super().__init__(capacity)
        self.page_size = page_size
        self.kmin = torch.full((self.capacity, num_kv_heads, pages, head_dim), _INF, device=device)
        self.kmax = torch.full((self.capacity, num_kv_heads, pages, head_dim), -_INF, device=device)
        self.n_tokens = torch.zeros(self.capacity, dtype=torch.long, device=device)

    def reset_slot(self, slot: int) -> None:
        self.kmin[slot] = _INF
        self.kmax[slot] = -_INF
        self.n_tokens[slot] = 0

    def used_extent(self, slot: int) -> int:
        return -(-int(self.n_tokens[slot]) // self.page_size)

    def ensure_extent(self, n: int) -> None:
        self._ensure_pages(n)

    def _ensure_pages(self, n: int) -> None:
        old = self.kmin.shape[2]
        if n <= old:
            return
        new = max(n, 2 * old)
        S, H_kv, _, d = self.kmin.shape
        kmin = self.kmin.new_full((S, H_kv, new, d), _INF)
        kmax = self.kmax.new_full((S, H_kv, new, d), -_INF)
        kmin[:, :, :old], kmax[:, :, :old] = self.kmin, self.kmax
        self.kmin, self.kmax = kmin, kmax

    def update(self, slots: torch.Tensor, kv: PagedKV) -> None:
        """Fold positions n_tokens[slot] .. L_b - 1 of each sequence b into its page bounds.

        slots (B,) int64; kv holds the same B sequences. On a decode step this is the one new token.
        """
        new = new_keys(self.n_tokens, slots, kv)
        if new is None:
            return
        pos, keys = new  # (B, M), (B, H_kv, M, d)
        L = kv.lengths.to(slots.device)  # (B,)
        P, H_kv, d = self.page_size, kv.num_kv_heads, kv.head_dim
        self._ensure_pages(-(-int(L.max()) // P))
        B, M = pos.shape
        g = torch.arange(H_kv, device=slots.device).view(1, H_kv, 1)
        keys = keys.float().reshape(-1, d)  # (B*H_kv*M, d)
        N_p = self.kmin.shape[2]
        rows = (slots.view(B, 1, 1) * H_kv + g) * N_p + (pos // P).view(B, 1, M)  # (B, H_kv, M) page rows
        idx = rows.reshape(-1, 1).expand(-1, d)
        self.kmin.view(-1, d).scatter_reduce_(0, idx, keys, reduce="amin", include_self=True)
        self.kmax.view(-1, d).scatter_reduce_(0, idx, keys, reduce="amax", include_self=True)
        self.n_tokens[slots] = L


class Quest(KeyTracking):  # prefill folds the prompt's (or a later turn's) new keys into the page bounds
    name = "quest"
    config_class = QuestConfig

    def init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                   capacity: int = 1) -> QuestPageState:
        return QuestPageState(num_kv_heads, head_dim, self.config.page_size, device, capacity)

    def check_state(self, tensors: dict[str, torch.Tensor], length: int) -> None:
        """n_tokens in [0, length] and the same in every layer, the page bounds as many pages as they cover (the
        pool grows to them): ceil(n_tokens / P)."""
        state_bounds.require(tensors, QuestPageState.field_names())
        state_bounds.integers_within(tensors, "n_tokens", 0, length, "the session's tokens")
        n = tensors["n_tokens"]
        if n.numel() and bool((n != n.flatten()[0]).any()):
            raise ValueError("method state: n_tokens must be the same in every layer")
        pages = -(-int(n.flatten()[0]) // self.config.page_size) if n.numel() else 0
        for name in ("kmin", "kmax"):
            state_bounds.extent(tensors, name, 2, pages, "pages (ceil(n_tokens / page_size))")

    def decode(self, q: torch.Tensor, kv: PagedKV, state: QuestPageState, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        P, K = self.config.page_size, self.config.top_k
        state.update(slots, kv)  # the current token's key joins its page first
        L = kv.lengths.to(q.device)  # (B,)
        n_pages = (L + P - 1) // P  # (B,)
        N_p = int(n_pages.max())
        kv_heads(H, kv.num_kv_heads)  # raises unless H is a multiple of H_kv
        H_kv = kv.num_kv_heads
        G = H // H_kv  # query heads g*G .. (g+1)*G - 1 read KV head g
        qf = q.float().view(B, H_kv, G, d)
        bound = torch.full((B, H, N_p), NEG_INF, device=q.device)  # U_p, -inf past each sequence's pages
        for b in range(B):  # views of one slot's live pages (no copy of the page table)
            s, n = int(slots[b]), int(n_pages[b])
            qt = qf[b].transpose(-1, -2)  # (H_kv, d, G)
            ub = state.kmax[s, :, :n] @ qt.clamp(min=0) + state.kmin[s, :, :n] @ qt.clamp(max=0)  # (H_kv, n, G)
            bound[b, :, :n] = ub.transpose(-1, -2).reshape(H, n)

        kp = min(N_p, K // P + 1)  # at most one partial page, so no more pages can fit
        top, ranked = bound.topk(kp, dim=-1)  # (B, H, kp) pages by descending bound
        size = (L.view(B, 1, 1) - ranked * P).clamp(max=P)  # (B, H, kp) tokens in each ranked page
        size = size.masked_fill(top == NEG_INF, 0)
        take = size.cumsum(-1) <= K  # (B, H, kp) the longest ranked prefix within the budget
        pos = ranked.unsqueeze(-1) * P + torch.arange(P, device=q.device)  # (B, H, kp, P)
        ok = take.unsqueeze(-1) & (top > NEG_INF).unsqueeze(-1) & (pos < L.view(B, 1, 1, 1))
        sel = pos.masked_fill(~ok, -1).view(B, H, kp * P)  # (B, H, kp*P) -1 padded
        out, n_valid = attend_positions(q, kv, sel, scale)  # (B, H, d_v), (B, H)
        n_approx = n_pages.to(torch.int32).view(B, 1).expand(B, H)
        return step_output(out, full_path(B, H, Path.APPROX, q.device), n_valid, sel, n_approx)
