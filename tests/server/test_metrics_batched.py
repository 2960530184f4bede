"""The per-step statistics batched (runtime/stats.py's StepStatsBatch, the metrics' one pass over it) against the
per-row code they replaced, kept here as the reference: the runner's per-group collection into one StepStats
per row (each computing its own group reads), and the observer's ``on_step`` that stacked those rows again.
The same steps go through both; the two registries' scrapes must be identical, text for text.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from retopk_core.methods.base import Path
from retopk_server.metrics import EXACT_PATHS, FOLD_STEPS, NUM_PATHS, MetricsObserver, step_path_label
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.stats import StepStats, StepStatsBatch

LAYERS, HEADS, KV_HEADS = 5, 6, 3


def per_row_collect(groups, batch: int) -> list[StepStats]:
    """The runner's collection before batching: per group its per-layer (n, H) tensors stacked to (layers, n, H),
    then one StepStats per row over its (layers, H) slice."""
    out: list[StepStats | None] = [None] * batch
    for rows, per_layer, seconds in groups:
        path = torch.stack([p for p, _, _ in per_layer]).to(torch.int8).cpu()  # (layers, n, H)
        max_sim = torch.stack([m for _, m, _ in per_layer]).float().cpu()
        n_scored = torch.stack([n for _, _, n in per_layer]).to(torch.int32).cpu()
        for j, row in enumerate(rows):
            out[row] = StepStats(path[:, j], max_sim[:, j], n_scored[:, j], seconds, num_kv_heads=KV_HEADS)
    return out


def _stack(tensors: list) -> np.ndarray:
    return torch.stack(tensors).cpu().numpy()


class PerRowObserver(MetricsObserver):
    """MetricsObserver whose ``on_step`` is the per-row one it had before batching (a list of StepStats)."""

    def on_step(self, requests: list, seconds: float, stats: list | None) -> None:
        m, model = self.metrics, self.model
        self._one["step"].observe(seconds)
        self._one["batch"].observe(len(requests))
        if not stats or not self.wants_step_stats:
            return
        path = _stack([s.path for s in stats]).astype(np.int64)  # (B, layers, heads)
        _, layers, heads = path.shape
        np.clip(path, 0, NUM_PATHS - 1, out=path)
        offsets = np.arange(layers * heads).reshape(1, layers, heads) * NUM_PATHS
        flat = offsets + path
        counts = np.bincount(flat.reshape(-1), minlength=layers * heads * NUM_PATHS).reshape(layers, heads, NUM_PATHS)
        m.decisions.add(model, counts)
        group_read = _stack([s.group_read for s in stats])  # (B, layers, H_kv) bool
        batch, _, kv_heads = group_read.shape
        m.group_reads.add(model, group_read.sum(axis=(0, 2), dtype=np.int64))
        m.group_steps.add(model, np.full(layers, batch * kv_heads, np.int64))
        per_path = counts.sum(axis=(0, 1))
        total = int(per_path.sum())
        if total:
            self._one["exact_share"].set(float(per_path[list(EXACT_PATHS)].sum()) / total)
        if per_path[Path.REUSE]:
            n_scored = _stack([s.n_scored for s in stats])
            m.candidate_size.observe_many(model, n_scored[path == Path.REUSE])
        m.max_similarity.observe_many(model, _stack([s.max_sim for s in stats]))
        groups: dict[object, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.method, []).append(i)
        for rows in groups.values():
            mix = per_path if len(groups) == 1 else np.bincount(path[rows].reshape(-1), minlength=NUM_PATHS)
            m.attention.labels(model, step_path_label(mix)).observe(stats[rows[0]].attention_s)


def started_pair(default_method: MethodSpec) -> tuple[MetricsObserver, PerRowObserver]:
    """A batched observer and the per-row reference, both started on one small model's info."""
    info = SimpleNamespace(num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS, architecture="A",
                           head_dim=8, device="cpu", backend="torch", default_method=default_method,
                           weight_format="f32", kv_dtype="float32")
    batched, reference = MetricsObserver("m"), PerRowObserver("m")
    for observer in (batched, reference):
        observer.on_start(info, None)
    return batched, reference


def random_groups(gen: torch.Generator, group_rows: list[list[int]], dense: set[int] = frozenset(),
                  layers: int = LAYERS):
    """Per group (rows, per layer (path int8, max_sim float32, n_scored int32) each (n, H), seconds), as a
    step's DecodeContext holds them: any path code, NaN similarities here and there; a group in ``dense`` has
    the shared-constant shape of a dense step (every head one path, NaN, n_scored expanded from (n, 1))."""
    groups = []
    for g, rows in enumerate(group_rows):
        n, per_layer = len(rows), []
        for _ in range(layers):
            if g in dense:
                lengths = torch.randint(1, 900, (n,), generator=gen)
                per_layer.append((torch.full((n, HEADS), int(Path.DENSE), dtype=torch.int8),
                                  torch.full((n, HEADS), float("nan")),
                                  lengths.to(torch.int32).view(n, 1).expand(n, HEADS)))
                continue
            codes = torch.tensor([0, 0, 0, 1, 2, 7, 3], dtype=torch.int8)  # reuse three times as likely
            path = codes[torch.randint(0, len(codes), (n, HEADS), generator=gen)]
            sim = torch.rand(n, HEADS, generator=gen) * 2 - 1
            sim[torch.rand(n, HEADS, generator=gen) < 0.1] = float("nan")
            per_layer.append((path, sim, torch.randint(1, 70000, (n, HEADS), generator=gen).to(torch.int32)))
        groups.append((rows, per_layer, float(torch.rand(1, generator=gen)) * 0.01))
    return groups


def scrape_text(observer: MetricsObserver) -> str:
    """The exposition without the process collector's lines and the _created timestamps (they differ between two
    observers made one after the other)."""
    return "\n".join(line for line in generate_latest(observer.metrics.registry).decode().splitlines()
                     if "process_" not in line and "_created{" not in line)


@pytest.mark.parametrize("group_rows, dense", [
    ([[0, 1, 2, 3, 4, 5, 6, 7]], set()),  # the server's usual step: one method group in row order
    ([[0, 2, 5], [1, 3], [4]], set()),  # groups interleaved in the batch
    ([[1, 3, 4], [0, 2]], {1}),  # a dense group's shared constants beside a ReTopK group
])
def test_a_batched_step_scrapes_as_the_per_row_code_did(group_rows, dense):
    gen = torch.Generator().manual_seed(len(group_rows))
    batch = sum(len(rows) for rows in group_rows)
    specs = [MethodSpec.of("retopk", tau=0.1 * (g + 1)) for g in range(len(group_rows))]
    requests = [None] * batch
    for spec, rows in zip(specs, group_rows, strict=True):
        for row in rows:
            requests[row] = SimpleNamespace(method=spec)
    batched, reference = started_pair(specs[0])
    for step in range(4):
        groups = random_groups(gen, group_rows, dense)
        rows = per_row_collect(groups, batch)
        stats = StepStatsBatch.of_groups(batch, groups, KV_HEADS)
        for i, row in enumerate(rows):  # each row of the batch is the per-row code's StepStats
            got = stats[i]
            for name in ("path", "max_sim", "n_scored", "group_read"):
                assert torch.equal(getattr(got, name).nan_to_num(-9), getattr(row, name).nan_to_num(-9)), (i, name)
                assert getattr(got, name).dtype == getattr(row, name).dtype
            assert got.attention_s == row.attention_s and got.counts() == row.counts()
        batched.on_step(requests, 0.01 * (step + 1), stats)
        reference.on_step(requests, 0.01 * (step + 1), rows)
    text = scrape_text(batched)
    assert text == scrape_text(reference)
    assert 'retopk_candidate_set_size_count{model="m"}' in text and "retopk_kv_group_reads_total" in text


@pytest.mark.parametrize("layouts", [
    [([[0]], set()), ([[0, 1, 2]], set()), ([[0, 2], [1]], set()), ([[1], [0, 2, 3]], {0})],  # varying steps
    [([[0, 1, 2]], set())],  # the server's steady load: one method group in row order, the same batch every step
])
def test_steps_folded_together_scrape_as_each_step_alone(layouts):
    """More steps than FOLD_STEPS, of varying or equal batches and method groups and (once) another layer count,
    scraped midway and at the end: the folds of the steps waiting read as the per-row code's step-at-a-time
    records."""
    gen = torch.Generator().manual_seed(7)
    specs = [MethodSpec.of("retopk", tau=0.1 * (g + 1)) for g in range(3)]
    batched, reference = started_pair(specs[0])
    for step in range(2 * FOLD_STEPS + 5):
        group_rows, dense = layouts[step % len(layouts)]
        batch = sum(len(rows) for rows in group_rows)
        requests = [None] * batch
        for spec, rows in zip(specs, group_rows, strict=False):
            for row in rows:
                requests[row] = SimpleNamespace(method=spec)
        layers = LAYERS + 1 if step == FOLD_STEPS + 2 else LAYERS  # one step of another shape restarts the counts
        groups = random_groups(gen, group_rows, dense, layers)
        batched.on_step(requests, 0.01, StepStatsBatch.of_groups(batch, groups, KV_HEADS))
        reference.on_step(requests, 0.01, per_row_collect(groups, batch))
        if step in (5, FOLD_STEPS + 4):  # a scrape between folds reads every step so far
            assert scrape_text(batched) == scrape_text(reference), step
    text = scrape_text(batched)
    assert text == scrape_text(reference)
    assert 'path="refresh"' in text  # the attention time's labels are the steps' own mixes


def test_the_steps_waiting_fold_every_fold_steps_without_a_scrape():
    """The counters' own totals (no collect) take each FOLD_STEPS steps at once: memory held stays bounded and a
    scrape finds at most FOLD_STEPS - 1 steps to fold."""
    gen = torch.Generator().manual_seed(3)
    observer = MetricsObserver("m")
    requests = [SimpleNamespace(method=None)] * 2
    for step in range(1, 2 * FOLD_STEPS + 1):
        observer.on_step(requests, 0.01, StepStatsBatch.of_groups(2, random_groups(gen, [[0, 1]]), KV_HEADS))
        totals = observer.metrics.decisions.totals("m")
        folded = 0 if totals is None else int(totals.sum())
        assert folded == (step // FOLD_STEPS) * FOLD_STEPS * 2 * LAYERS * HEADS, step


@pytest.mark.parametrize("group_rows, stacked", [
    ([[[0, 1, 2]]] * 4, ()),  # one group in row order, equal batches: stacked together
    ([[[0, 1, 2]], [[0]], [[0, 1]]], ()),  # one group in row order, unequal batches
    ([[[0, 1, 2]], [[0]], [[1], [0]]], ()),  # interleaved groups
    ([[[0, 1]]] * 3, (1,)),  # a batch already stacked (read by a request that asked for its statistics)
])
def test_concat_is_the_steps_rows_one_after_another(group_rows, stacked):
    gen = torch.Generator().manual_seed(5)
    steps = [random_groups(gen, rows) for rows in group_rows]
    batches = [StepStatsBatch.of_groups(sum(map(len, rows)), groups, KV_HEADS)
               for rows, groups in zip(group_rows, steps, strict=True)]
    for i in stacked:
        assert batches[i].path.shape[0] == len(batches[i])
    got = StepStatsBatch.concat(batches)
    want = [row for rows, groups in zip(group_rows, steps, strict=True)
            for row in per_row_collect(groups, sum(map(len, rows)))]
    assert len(got) == len(want) and got.shape == (len(want), LAYERS, HEADS)
    for name in ("path", "max_sim", "n_scored", "group_read"):
        expected = torch.stack([getattr(row, name) for row in want])
        assert getattr(got, name).dtype == expected.dtype
        assert torch.equal(getattr(got, name).nan_to_num(-9), expected.nan_to_num(-9)), name
    assert got.attention_s == [row.attention_s for row in want]


def test_of_rows_stacks_hand_made_rows_and_rejects_mismatched_shapes():
    rows = [StepStats(torch.full((2, 3), int(Path.REUSE), dtype=torch.int8), torch.ones(2, 3),
                      torch.full((2, 3), 7, dtype=torch.int32), 0.5, num_kv_heads=3) for _ in range(2)]
    rows[1].path[1, 2] = Path.FALLBACK
    batch = StepStatsBatch.of_rows(rows)
    assert len(batch) == 2 and batch.path.shape == (2, 2, 3)
    assert batch.group_read.tolist() == [[[False] * 3] * 2, [[False] * 3, [False, False, True]]]
    assert [s.counts() for s in batch] == [{"reuse": 6}, {"reuse": 5, "fallback": 1}]
    assert [s.attention_s for s in batch[-1:]] == [0.5]
    with pytest.raises(IndexError):
        batch[2]
    with pytest.raises(ValueError, match="one \\(B, layers, heads\\) shape"):
        StepStatsBatch(batch.path, batch.max_sim[:, :1], batch.n_scored, [0.5, 0.5], 3)
