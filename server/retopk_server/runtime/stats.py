"""Per-step path statistics of the attention core, reported on request."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from retopk_core.methods.base import PATH_NAMES, group_reads


@dataclass
class StepStats:
    """One session's decode step over all layers (codes from ``retopk_core.methods.base.Path``).

    path          (layers, heads) int8     path each head took (reuse / fallback / refresh / promoted / exact ...)
    max_sim       (layers, heads) float32  max cached-query cosine (NaN where the method has none)
    n_scored      (layers, heads) int32    keys scored with the exact query (candidates on ReTopK's reuse path)
    attention_s   seconds spent in the attention core on this step for the session's method group,
                  summed over layers (CUDA events on a GPU, wall time on a CPU; no synchronisation)
    num_kv_heads  H_kv, the model's KV heads (query head h reads KV group h // (heads / H_kv))
    group_read    (layers, H_kv) bool, derived: ``group_reads(path, num_kv_heads)``, True where the KV group's
                  keys were read in full on this step. Its mean is the step's group-read rate, what the step
                  costs under GQA (one exact head reads its whole group).
    """

    path: torch.Tensor
    max_sim: torch.Tensor
    n_scored: torch.Tensor
    attention_s: float = 0.0
    num_kv_heads: int = field(kw_only=True)
    group_read: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.group_read = group_reads(self.path, self.num_kv_heads)  # (layers, H_kv) bool; checks H % H_kv

    def counts(self) -> dict[str, int]:
        """Heads-times-layers per path name, e.g. {"reuse": 250, "fallback": 20}."""
        values, n = torch.unique(self.path.to(torch.int64), return_counts=True)
        return {PATH_NAMES.get(int(v), str(int(v))): int(c) for v, c in zip(values.tolist(), n.tolist(), strict=True)}
