"""A measuring wrapper: run any method and, on the same q and KV, Exact Top-K and full attention.

``make_method("fidelity_probe", inner="retopk", recorder=rec, top_k=64, ...)`` decodes exactly as the
inner method (its output is returned unchanged) and, per (sequence, layer, head) of every decode step,
records into ``rec`` (a ``FidelityRecorder``) against the same step's exact references:

    support recall   |Ŝ ∩ S| / |S|        S = Exact Top-K support (K = the inner method's top_k)
    retained mass    Σ_{i∈Ŝ} p_i          p = full-softmax probabilities over the whole history
    output cosine    cos(ô, o)            o = full-attention output

grouped by the path the inner method took (reuse / fallback / refresh / ...). A dense inner method
(no selection) counts as recall 1 and mass 1. Costs an extra full-history pass per layer: for
evaluation only.
Importing this module registers it as an evaluation wrapper: ``make_method`` builds it by name, a server
never offers it (``registry.serving_method_names``).
"""

from __future__ import annotations

import math

import torch

from retopk_core.fidelity import full_probabilities, output_cosine, retained_mass, support_recall
from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput
from retopk_core.methods.registry import make_method, register
from retopk_core.methods.sparse import dense_attend, exact_select, resolve_scale

METRICS = ("recall", "mass", "cosine")
N_PATHS = len(Path)


class FidelityRecorder:
    """Per (layer, head, path) sums of each metric and counts, plus a similarity-binned view.

    sums[m]     (layers, H, N_PATHS) float64   Σ metric m
    count       (layers, H, N_PATHS) int64     head-steps
    sim_bins    edges of max cached-query similarity bins (ReTopK only; NaN similarities are skipped)
    by_sim[m]   (n_bins,) Σ metric m per similarity bin, sim_count (n_bins,)
    """

    def __init__(self, sim_bins: tuple[float, ...] = (-1.0, 0.5, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0001)) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count: torch.Tensor | None = None
        self.sim_edges = torch.tensor(sim_bins, dtype=torch.float64)
        nb = len(sim_bins) - 1
        self.by_sim = {m: torch.zeros(nb, dtype=torch.float64) for m in METRICS}
        self.sim_count = torch.zeros(nb, dtype=torch.int64)

    def _ensure(self, layer: int, heads: int) -> None:
        n = 0 if self.count is None else self.count.shape[0]
        if layer < n:
            return
        grow = layer + 1 - n
        zeros = torch.zeros(grow, heads, N_PATHS, dtype=torch.float64)
        self.count = zeros.long() if self.count is None else torch.cat([self.count, zeros.long()])
        for m in METRICS:
            self.sums[m] = zeros.clone() if m not in self.sums else torch.cat([self.sums[m], zeros])

    def add(self, layer: int, path: torch.Tensor, max_sim: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """path (B, H) int8, max_sim (B, H), values[m] (B, H) for one layer's decode step."""
        B, H = path.shape
        self._ensure(layer, H)
        p = path.long().cpu()  # (B, H)
        heads = torch.arange(H).expand(B, H)
        self.count[layer].index_put_((heads.reshape(-1), p.reshape(-1)), torch.ones(B * H, dtype=torch.int64),
                                     accumulate=True)
        sim = max_sim.double().cpu().reshape(-1)
        ok = ~torch.isnan(sim)
        bins = (torch.bucketize(sim[ok], self.sim_edges, right=True) - 1).clamp(0, len(self.sim_count) - 1)
        self.sim_count.index_add_(0, bins, torch.ones_like(bins))
        for m in METRICS:
            v = values[m].double().cpu()
            self.sums[m][layer].index_put_((heads.reshape(-1), p.reshape(-1)), v.reshape(-1), accumulate=True)
            self.by_sim[m].index_add_(0, bins, v.reshape(-1)[ok])

    def mean(self, metric: str, paths: tuple[int, ...] | None = None) -> float:
        """Mean over every recorded head-step (of the given path codes)."""
        if self.count is None:
            return math.nan
        sel = list(paths) if paths is not None else list(range(N_PATHS))
        n = int(self.count[..., sel].sum())
        return float(self.sums[metric][..., sel].sum()) / n if n else math.nan

    def heatmap(self, metric: str, paths: tuple[int, ...] | None = None) -> torch.Tensor:
        """(layers, H) mean of the metric per layer and head (NaN where nothing was recorded)."""
        sel = list(paths) if paths is not None else list(range(N_PATHS))
        n = self.count[..., sel].sum(-1).double()
        return self.sums[metric][..., sel].sum(-1) / n.where(n > 0, torch.tensor(float("nan"), dtype=torch.float64))

    def share(self, paths: tuple[int, ...]) -> float:
        total = int(self.count.sum()) if self.count is not None else 0
        return int(self.count[..., list(paths)].sum()) / total if total else math.nan

    def similarity_table(self) -> list[dict]:
        rows = []
        for i in range(len(self.sim_count)):
            n = int(self.sim_count[i])
            lo, hi = float(self.sim_edges[i]), min(1.0, float(self.sim_edges[i + 1]))
            rows.append({"sim_lo": lo, "sim_hi": hi, "n": n,
                         **{m: (float(self.by_sim[m][i]) / n if n else math.nan) for m in METRICS}})
        return rows


class ProbeState(SlotPool):
    """The inner method's state of one layer, plus the layer's index (the state pool API delegates)."""

    def __init__(self, inner: SlotPool, layer: int) -> None:
        self.inner = inner
        self.layer = layer

    @property
    def generation(self) -> int:
        """The inner pool's (SlotPool.generation): this one replaces no tensor of its own."""
        return self.inner.generation

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def free_slots(self) -> int:
        return self.inner.free_slots

    def prepare_grow(self, capacity: int) -> dict[str, torch.Tensor]:
        return self.inner.prepare_grow(capacity)

    def commit_grow(self, capacity: int, grown: dict[str, torch.Tensor]) -> None:
        self.inner.commit_grow(capacity, grown)

    def highest_used(self) -> int:
        return self.inner.highest_used()

    def shrink(self, capacity: int) -> None:
        self.inner.shrink(capacity)

    def alloc(self, fresh: bool = True) -> int:
        return self.inner.alloc(fresh)

    def free(self, slot: int) -> None:
        self.inner.free(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        self.inner.copy_slot(src, dst)

    def reset_slot(self, slot: int) -> None:
        self.inner.reset_slot(slot)

    def nbytes_per_slot(self) -> int:
        return self.inner.nbytes_per_slot()


class FidelityProbe(AttentionMethod):
    name = "fidelity_probe"
    config_class = None  # its keywords: inner=, recorder= and the inner method's hyperparameters

    def __init__(self, inner: str = "retopk", recorder: FidelityRecorder | None = None, backend: str = "torch",
                 **params) -> None:
        self.inner = make_method(inner, backend=backend, **params)
        self.recorder = recorder if recorder is not None else FidelityRecorder()
        self.top_k = int(params.get("top_k", getattr(self.inner, "top_k", 0)) or 0) or None
        self.prefill_queries = self.inner.prefill_queries
        self._layers = 0  # init_state is called once per model layer, in layer order

    def init_state(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                   capacity: int = 1) -> ProbeState:
        state = ProbeState(self.inner.init_state(num_heads, num_kv_heads, head_dim, device=device,
                                                 capacity=capacity), self._layers)
        self._layers += 1
        return state

    def prefill(self, state: ProbeState, slot: int, q, positions, kv, scale: float | None = None) -> None:
        self.inner.prefill(state.inner, slot, q, positions, kv, scale=scale)

    @torch.no_grad()
    def decode(self, q: torch.Tensor, kv, state: ProbeState, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        res = self.inner.decode(q, kv, state.inner, slots, scale=scale)
        B, H, d = q.shape
        s = resolve_scale(scale, d)
        full_out = dense_attend(q, kv, s)  # (B, H, d_v)
        cosine = output_cosine(res.out, full_out)  # (B, H)
        if res.selected is None:
            recall = torch.ones(B, H)
            mass = torch.ones(B, H)
        else:
            K = self.top_k or res.selected.shape[-1]
            exact, _ = exact_select(q, kv, K, s)  # (B, H, K)
            recall = support_recall(res.selected, exact)  # (B, H)
            mass = retained_mass(full_probabilities(q, kv, s), res.selected)  # (B, H)
        self.recorder.add(state.layer, res.path, res.max_sim, {"recall": recall, "mass": mass, "cosine": cosine})
        return res

    def describe(self) -> dict:
        inner = self.inner.describe()
        return {**inner, "method": self.name, "inner": inner["method"]}


register(FidelityProbe.name, f"{__name__}:FidelityProbe", serving=False)
