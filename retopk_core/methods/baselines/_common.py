"""Small helpers shared by the baseline methods (on top of ``retopk_core.methods.sparse``).

Every baseline ends the same way: a set of positions per (sequence, query head), -1 padded, whose
exact scores q . k_i * scale are computed and softmax-attended (``attend_positions``). What differs
is how the positions are chosen; each method file states its selector.
"""

from __future__ import annotations

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.base import AttentionMethod, Path, StepOutput
from retopk_core.methods.sparse import indexed_scores, kv_heads, sparse_attend
from retopk_core.params import MethodConfig


class Baseline(AttentionMethod):
    """A baseline: built from its config; ``backend`` "torch" or "triton" both run the torch code.

    The baselines have no Triton kernels; their torch code runs on whatever device the tensors live on
    (a GPU included), so a server configured with backend="triton" can still select them by name.
    """

    def __init__(self, config: MethodConfig | None = None, backend: str = "torch") -> None:
        super().__init__(config, backend)
        self.backend = "torch"


class KeyTracking(Baseline):
    """A baseline whose per-layer state follows each sequence's keys (``state.update(slots, kv)`` folds the
    positions it has not seen yet): every prefill folds the new prompt's (or turn's) keys."""

    def prefill(self, state, slot: int, q: torch.Tensor | None, positions: torch.Tensor | None, kv: PagedKV,
                scale: float | None = None) -> None:
        state.update(torch.tensor([slot], device=state.n_tokens.device), kv)


def new_keys(n_tokens: torch.Tensor, slots: torch.Tensor, kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The keys a state has not folded yet: positions n_tokens[slot] .. L_b - 1 of each sequence b.

    n_tokens (S,) int64, slots (B,) int64 (kv holds the same B sequences) -> pos (B, M) int64 and keys
    (B, H_kv, M, d), M the most new positions of any sequence; shorter rows repeat their last position
    (folding a key twice changes neither a min/max nor a projection). None when nothing is new.
    """
    L = kv.lengths.to(slots.device)  # (B,)
    n0 = n_tokens[slots]  # (B,)
    M = int((L - n0).max()) if len(slots) else 0
    if M <= 0:
        return None
    B, H_kv, dev = len(slots), kv.num_kv_heads, slots.device
    pos = n0.view(B, 1) + torch.arange(M, device=dev).view(1, M)  # (B, M)
    pos = torch.where(pos < L.view(B, 1), pos, L.view(B, 1) - 1)
    g = torch.arange(H_kv, device=dev).view(1, H_kv, 1)
    return pos, kv.gather_k(kv.flat_rows(torch.arange(B, device=dev).view(B, 1, 1), g, pos.view(B, 1, M)))


def attend_positions(q: torch.Tensor, kv: PagedKV, sel_pos: torch.Tensor, scale: float,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact sparse attention of each head over its selected positions.

    q (B, H, d), sel_pos (B, H, K) int64, -1 padded, every row with >= 1 valid position
    -> out (B, H, d_v) in q's dtype, n_valid (B, H) int32 (positions scored exactly and attended)
    """
    B, H, K = sel_pos.shape
    b = torch.arange(B, device=q.device).view(B, 1).expand(B, H).reshape(-1)  # (B*H,)
    g = kv_heads(H, kv.num_kv_heads, q.device).view(1, H).expand(B, H).reshape(-1)  # (B*H,)
    scores = indexed_scores(q.reshape(B * H, -1), kv, b, g, sel_pos.reshape(B * H, K), scale)  # (B*H, K)
    out = sparse_attend(kv, sel_pos, scores.view(B, H, K), q.dtype)  # (B, H, d_v)
    return out, (sel_pos >= 0).sum(-1).to(torch.int32)


def step_output(out: torch.Tensor, path: torch.Tensor, n_scored: torch.Tensor, selected: torch.Tensor,
                n_approx: torch.Tensor | None = None) -> StepOutput:
    """A ``StepOutput`` with max_sim NaN (not defined for baselines) and n_approx 0 when not given."""
    B, H = path.shape
    if n_approx is None:
        n_approx = torch.zeros(B, H, dtype=torch.int32, device=out.device)
    return StepOutput(out=out, path=path.to(torch.int8), max_sim=torch.full((B, H), float("nan"), device=out.device),
                      n_scored=n_scored.to(torch.int32), selected=selected, n_approx=n_approx.to(torch.int32))


def full_path(B: int, H: int, path: Path, device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, H) int8 filled with one path code."""
    return torch.full((B, H), int(path), dtype=torch.int8, device=device)


def lengths_bh(kv: PagedKV, H: int) -> torch.Tensor:
    """(B, H) int32: each sequence's length repeated over its heads."""
    return kv.lengths.to(torch.int32).view(-1, 1).expand(-1, H).clone()

