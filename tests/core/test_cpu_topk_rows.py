"""The fused CPU kernel's ``topk_rows`` (ReTopK's prefill seeding) against torch.topk: the same positions as
a set, the best first with ties to the lower position, -1 where a row has fewer than k finite scores."""

from __future__ import annotations

import pytest
import torch

from retopk_core.cpu import launch
from retopk_core.methods.sparse import NEG_INF, topk_select

pytestmark = pytest.mark.skipif(not launch.available(), reason="the fused CPU kernel is not built")


def reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k best positions ordered by (score descending, position ascending), -1 for -inf picks:
    a stable sort, independent of the kernel's bar and blocks."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    picked = scores.gather(1, order)
    return order.masked_fill(picked == NEG_INF, -1)


@pytest.mark.parametrize("L", [5, 64, 100, 1024 + 7, 4112])
@pytest.mark.parametrize("k", [1, 8, 64])
def test_topk_rows_equals_a_stable_sort(L, k):
    g = torch.Generator().manual_seed(L * 100 + k)
    scores = torch.randn(12, L, generator=g)
    scores[1] = torch.arange(L, dtype=torch.float32)  # rising: every entry beats the bar so far
    scores[2] = -torch.arange(L, dtype=torch.float32)
    scores[3] = torch.randint(0, 3, (L,), generator=g).float()  # ties everywhere
    scores[4, L // 2:] = NEG_INF  # a causal row
    scores[5, 1:] = NEG_INF  # one visible key: the rest of its k picks are -1
    scores[6, :] = NEG_INF
    got = launch.topk_rows(scores, k)
    want = reference(scores, min(k, L))
    if k > L:
        want = torch.cat([want, want.new_full((12, k - L), -1)], dim=1)
    assert torch.equal(got, want)
    # the same set as the torch code path's Top-K where no two scores tie
    sets = topk_select(scores[[0, 1, 2]], None, k)[0].sort(-1).values
    assert torch.equal(got[[0, 1, 2]].sort(-1).values, sets)


def test_topk_rows_reads_strided_rows_and_skips_nan():
    scores = torch.randn(6, 300)
    scores[0, 10] = float("nan")
    view = scores[:, :250]  # row stride 300
    got = launch.topk_rows(view, 16)
    assert 10 not in got[0].tolist()
    clean = view.clone()
    clean[0, 10] = NEG_INF
    assert torch.equal(got, reference(clean, 16))


def test_topk_rows_refuses_bad_input():
    with pytest.raises(ValueError, match="float32"):
        launch.topk_rows(torch.zeros(2, 8, dtype=torch.float64), 2)
    with pytest.raises(ValueError, match="k must be positive"):
        launch.topk_rows(torch.zeros(2, 8), 0)
