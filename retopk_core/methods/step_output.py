"""What one decode step returns, in every backend: the ``Path`` code each head took, ``StepOutput`` (and
``uniform_output`` for a step on which every head took one path), and which KV groups a step read in full
(``group_reads``). A leaf (torch only), so the launchers of the fused CPU kernel and of the Triton kernels
import it without importing the methods that call them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import IntEnum

import torch


class Path(IntEnum):
    """What a head did on one decode step (stored as int8 in ``StepOutput.path``)."""

    REUSE = 0  # ReTopK: recalled supports + window, reranked
    FALLBACK = 1  # ReTopK: max cached-query similarity < tau -> Exact Top-K
    REFRESH = 2  # ReTopK: scheduled Exact Top-K every T_r steps
    EXACT = 3  # Exact Top-K method: full-history scores, global Top-K
    DENSE = 4  # Full attention: every position
    APPROX = 5  # a baseline's own selector (StreamingLLM, Quest, SparQ, Loki, TokenSelect)
    CACHED = 6  # TokenSelect: previous step's selection reused
    PROMOTED = 7  # ReTopK GQA policies: would reuse, but its KV group's keys were read in full, so exact


PATH_NAMES = {p.value: p.name.lower() for p in Path}
# Paths that read every key of the head's KV group. A group read happens on a (layer, sequence, KV group,
# step) when any of its heads takes one: that read, not the per-head path, is what a step costs.
FULL_READ_PATHS = (Path.FALLBACK, Path.REFRESH, Path.PROMOTED, Path.EXACT, Path.DENSE)


def group_reads(path: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Which KV groups had every key read: path (..., H) int codes -> (..., H_kv) bool.

    Group g holds query heads g*G .. g*G + G - 1 (G = H // H_kv, as ``kv_heads``); it is read when any of
    them took a path in ``FULL_READ_PATHS``. The group-read rate is the mean of this over layers, KV
    groups and decode steps.
    """
    H = path.shape[-1]
    if H % num_kv_heads:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({num_kv_heads})")
    full = torch.zeros_like(path, dtype=torch.bool)
    for p in FULL_READ_PATHS:
        full |= path == p
    return full.unflatten(-1, (num_kv_heads, H // num_kv_heads)).any(-1)


@dataclass
class StepOutput:
    """Result of one decode step for B sequences and H query heads.

    out           (B, H, d_v)  attention output, in the query dtype
    path          (B, H) int8  ``Path`` value per head
    max_sim       (B, H) float32  max cached-query cosine (ReTopK), NaN where not defined
    n_scored      (B, H) int32  keys scored with the exact current query (the candidate count M_t
                               on ReTopK's reuse path, L on exact paths)
    selected      (B, H, K) int64  attended positions, -1 padded (None for dense attention)
    n_approx      (B, H) int32  keys scored approximately by a baseline's selector (0 otherwise)
    """

    out: torch.Tensor
    path: torch.Tensor
    max_sim: torch.Tensor
    n_scored: torch.Tensor
    selected: torch.Tensor | None
    n_approx: torch.Tensor | None = None


def uniform_output(out: torch.Tensor, path: Path, lengths: torch.Tensor,
                   selected: torch.Tensor | None = None) -> StepOutput:
    """The StepOutput of a step on which every head took ``path`` and scored all of its sequence's keys:
    out (B, H, d_v), lengths (B,) -> path (B, H) = ``path``, max_sim NaN, n_scored (B, H) = lengths.

    The path and max_sim tensors are constants shared by every step of that shape (readers only read them),
    so that a dense step pays for its attention, not for filling them each layer."""
    B, H = out.shape[:2]
    return StepOutput(out=out, path=constant((B, H), int(path), torch.int8, out.device),
                      max_sim=constant((B, H), float("nan"), torch.float32, out.device),
                      n_scored=lengths.to(torch.int32).view(B, 1).expand(B, H), selected=selected)


def constant(shape: tuple[int, ...], value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` filled with ``value``, made once per (shape, value, dtype, device): never write to it."""
    return _constant(shape, "nan" if value != value else value, dtype, device)  # NaN != NaN: keyed by name


@functools.lru_cache(maxsize=256)
def _constant(shape: tuple[int, ...], value: float | str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float(value), dtype=dtype, device=device)
