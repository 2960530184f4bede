"""Per-step path statistics of the attention core, reported on request: one decode step's rows stacked
(``StepStatsBatch``, what ``ModelRunner.decode`` returns and the metrics read in one pass) and one row's view of
them (``StepStats``, what a request that asked for them streams)."""

from __future__ import annotations

from collections.abc import Sequence
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
    group_read    (layers, H_kv) bool: ``group_reads(path, num_kv_heads)``, True where the KV group's keys were
                  read in full on this step (computed from ``path`` unless given, as a batch's row gives its
                  share of the batch's). Its mean is the step's group-read rate, what the step costs under GQA
                  (one exact head reads its whole group).
    """

    path: torch.Tensor
    max_sim: torch.Tensor
    n_scored: torch.Tensor
    attention_s: float = 0.0
    num_kv_heads: int = field(kw_only=True)
    group_read: torch.Tensor | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.group_read is None:
            self.group_read = group_reads(self.path, self.num_kv_heads)  # (layers, H_kv) bool; checks H % H_kv

    def counts(self) -> dict[str, int]:
        """Heads-times-layers per path name, e.g. {"reuse": 250, "fallback": 20}."""
        values, n = torch.unique(self.path.to(torch.int64), return_counts=True)
        return {PATH_NAMES.get(int(v), str(int(v))): int(c) for v, c in zip(values.tolist(), n.tolist(), strict=True)}


class StepStatsBatch(Sequence):
    """One decode step's statistics for its B rows, stacked once per step (row order of the step's sessions).

    path          (B, layers, heads) int8
    max_sim       (B, layers, heads) float32
    n_scored      (B, layers, heads) int32
    group_read    (B, layers, H_kv) bool, ``group_reads(path, num_kv_heads)`` over the whole batch at once
    attention_s   (B,) floats: each row's method group's attention-core seconds (rows of a group share it)
    num_kv_heads  H_kv

    ``batch[i]`` is row i's ``StepStats`` (views of these tensors, made when asked: only a request that asked for
    its step statistics needs one). A batch made by ``of_groups`` stacks its tensors when one is first read: the
    engine thread hands the step on at once, and the metrics read many steps' together (metrics.py's fold).
    """

    def __init__(self, path: torch.Tensor, max_sim: torch.Tensor, n_scored: torch.Tensor,
                 attention_s: Sequence[float], num_kv_heads: int) -> None:
        self.attention_s = [float(s) for s in attention_s]
        self.num_kv_heads = num_kv_heads
        self._groups = None  # of_groups' (batch, groups) until stacked
        self._stacked = self._checked(path, max_sim, n_scored)

    def _checked(self, path: torch.Tensor, max_sim: torch.Tensor, n_scored: torch.Tensor) -> tuple:
        """(path, max_sim, n_scored, group_read) once their shapes agree with one another and ``attention_s``."""
        if not (path.shape == max_sim.shape == n_scored.shape and path.dim() == 3
                and len(self.attention_s) == len(path)):
            raise ValueError(f"path {tuple(path.shape)}, max_sim {tuple(max_sim.shape)}, n_scored "
                             f"{tuple(n_scored.shape)} must be one (B, layers, heads) shape with B = "
                             f"len(attention_s) = {len(self.attention_s)}")
        return path, max_sim, n_scored, group_reads(path, self.num_kv_heads)  # group_read (B, layers, H_kv) bool

    @classmethod
    def of_groups(cls, batch: int, groups: Sequence[tuple[Sequence[int], list, float]],
                  num_kv_heads: int) -> StepStatsBatch:
        """The batch from its method groups' per-layer statistics: ``groups`` holds, per group, (its rows of the
        batch, per layer (path, max_sim, n_scored) each (n, H), its attention seconds); every row in one group.
        Its tensors are stacked when first read (``_stack``)."""
        attention_s = [0.0] * batch
        for rows, _, seconds in groups:
            for row in rows:
                attention_s[row] = seconds
        self = cls.__new__(cls)
        self.attention_s, self.num_kv_heads = attention_s, num_kv_heads
        self._groups, self._stacked = (batch, groups), None
        return self

    def _stack(self) -> tuple:
        """(path, max_sim, n_scored, group_read), stacked from ``of_groups``' per-layer tensors on first use."""
        if self._stacked is not None:
            return self._stacked
        batch, groups = self._groups
        parts = []
        for rows, per_layer, _ in groups:
            path = torch.stack([p for p, _, _ in per_layer], dim=1).to(torch.int8).cpu()  # (n, layers, H)
            max_sim = torch.stack([m for _, m, _ in per_layer], dim=1).float().cpu()
            n_scored = torch.stack([n for _, _, n in per_layer], dim=1).to(torch.int32).cpu()
            parts.append((rows, path, max_sim, n_scored))
        if len(parts) == 1 and list(parts[0][0]) == list(range(batch)):  # one group in row order: as it is
            _, path, max_sim, n_scored = parts[0]
        else:
            shape = (batch, *parts[0][1].shape[1:])
            path = torch.empty(shape, dtype=torch.int8)
            max_sim = torch.empty(shape, dtype=torch.float32)
            n_scored = torch.empty(shape, dtype=torch.int32)
            for rows, p, m, n in parts:
                index = torch.tensor(list(rows), dtype=torch.long)
                path[index], max_sim[index], n_scored[index] = p, m, n
        self._stacked, self._groups = self._checked(path, max_sim, n_scored), None
        return self._stacked

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, layers, heads), without stacking."""
        if self._stacked is not None:
            return tuple(self._stacked[0].shape)
        batch, groups = self._groups
        per_layer = groups[0][1]
        return batch, len(per_layer), per_layer[0][0].shape[-1]

    @classmethod
    def concat(cls, batches: Sequence[StepStatsBatch]) -> StepStatsBatch:
        """The rows of ``batches`` (steps of one (layers, heads) shape) one after another, as one batch. Steps of one
        method group in row order not yet stacked are stacked together, a tensor of every step's layers at once
        (what a batch alone stacks per step); others are concatenated as they stack."""
        attention_s = [s for b in batches for s in b.attention_s]
        num_kv_heads = batches[0].num_kv_heads
        lazy = [b._groups for b in batches if b._stacked is None]
        one_group = len(lazy) == len(batches) and all(
            len(groups) == 1 and list(groups[0][0]) == list(range(batch)) for batch, groups in lazy)
        if not one_group or len({batch for batch, _ in lazy}) != 1:
            return cls(*(torch.cat([b._stack()[i] for b in batches]) for i in range(3)), attention_s, num_kv_heads)
        per_layer = [t for _, groups in lazy for t in groups[0][1]]  # steps x layers of (path, max_sim, n_scored)
        n, layers = lazy[0][0], len(lazy[0][1][0][1])

        def rows(tensors: list[torch.Tensor]) -> torch.Tensor:  # (steps * layers) x (n, H) -> (steps * n, layers, H)
            t = torch.stack(tensors).cpu()  # (steps * layers, n, H)
            return t.view(len(lazy), layers, n, -1).transpose(1, 2).reshape(len(lazy) * n, layers, -1)

        return cls(rows([p for p, _, _ in per_layer]).to(torch.int8), rows([m for _, m, _ in per_layer]).float(),
                   rows([c for _, _, c in per_layer]).to(torch.int32), attention_s, num_kv_heads)

    @property
    def path(self) -> torch.Tensor:
        return self._stack()[0]

    @property
    def max_sim(self) -> torch.Tensor:
        return self._stack()[1]

    @property
    def n_scored(self) -> torch.Tensor:
        return self._stack()[2]

    @property
    def group_read(self) -> torch.Tensor:
        return self._stack()[3]

    @classmethod
    def of_rows(cls, rows: Sequence[StepStats]) -> StepStatsBatch:
        """The batch of one StepStats per row (a runner that collects them row by row, a test's hand-made ones)."""
        return cls(torch.stack([s.path for s in rows]).to(torch.int8), torch.stack([s.max_sim for s in rows]).float(),
                   torch.stack([s.n_scored for s in rows]).to(torch.int32), [s.attention_s for s in rows],
                   rows[0].num_kv_heads)

    def __len__(self) -> int:
        return len(self.attention_s)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of a batch of {len(self)}")
        return StepStats(self.path[i], self.max_sim[i], self.n_scored[i], self.attention_s[i],
                         num_kv_heads=self.num_kv_heads, group_read=self.group_read[i])
