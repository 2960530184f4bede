"""Per-step path statistics of the attention core, reported on request."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepStats:
    """One session's decode step over all layers (codes from ``retopk_core.methods.base.Path``).

    path         (layers, heads) int8     path each head took (reuse / fallback / refresh / exact / dense ...)
    max_sim      (layers, heads) float32  max cached-query cosine (NaN where the method has none)
    n_scored     (layers, heads) int32    keys scored with the exact query (candidates on ReTopK's reuse path)
    attention_s  wall seconds spent in the attention core on this step for the session's method group,
                 summed over layers (device-synchronised when stats are requested)
    """

    path: torch.Tensor
    max_sim: torch.Tensor
    n_scored: torch.Tensor
    attention_s: float = 0.0

    def counts(self) -> dict[str, int]:
        """Heads-times-layers per path name, e.g. {"reuse": 250, "fallback": 20}."""
        from retopk_core.methods.base import PATH_NAMES

        values, n = torch.unique(self.path.to(torch.int64), return_counts=True)
        return {PATH_NAMES.get(int(v), str(int(v))): int(c) for v, c in zip(values.tolist(), n.tolist(), strict=True)}
