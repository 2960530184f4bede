"""bitonic.py against torch.sort / torch.topk, and the (score, position) sort key's order."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from retopk_core.kernels.bitonic import (
    EMPTY,
    bitonic_merge_sort,
    bitonic_sort,
    bitonic_topk,
    pack_key,
    unpack_pos,
    unpack_score,
)
from tests.core.kernels._helpers import DEVICE


@triton.jit
def _sort_kernel(x_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, DESC: tl.constexpr, FULL: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    if FULL:
        y = bitonic_sort(x)
    else:
        y = bitonic_topk(x, K, DESC)
    tl.store(out_ptr + tl.arange(0, K), y)


@triton.jit
def _merge_sort_kernel(x_ptr, out_ptr, N: tl.constexpr, RUN: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, N), bitonic_merge_sort(tl.load(x_ptr + tl.arange(0, N)), RUN))


@triton.jit
def _key_kernel(s_ptr, p_ptr, n, key_ptr, top_s_ptr, top_p_ptr, N: tl.constexpr, K: tl.constexpr):
    i = tl.arange(0, N)
    m = i < n
    key = tl.where(m, pack_key(tl.load(s_ptr + i, mask=m, other=0.0), tl.load(p_ptr + i, mask=m, other=0)), EMPTY)
    tl.store(key_ptr + i, key)
    top = bitonic_topk(key, K, True)
    r = tl.arange(0, K)
    tl.store(top_s_ptr + r, unpack_score(top))
    tl.store(top_p_ptr + r, unpack_pos(top).to(tl.int32))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
@pytest.mark.parametrize("n,k", [(16, 16), (256, 32), (2048, 512)])
def test_sort_and_topk_match_torch(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = (torch.randn(n, generator=gen) * 1e4).to(dtype)
    x[: n // 8] = x[n // 8: n // 4]  # duplicates
    x = x.to(DEVICE)
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    _sort_kernel[(1,)](x, out, N=n, K=n, DESC=False, FULL=True)
    assert torch.equal(out, x.sort().values)
    top = torch.empty(k, dtype=dtype, device=DEVICE)
    _sort_kernel[(1,)](x, top, N=n, K=k, DESC=True, FULL=False)
    assert torch.equal(top, x.topk(k).values)
    low = torch.empty(k, dtype=dtype, device=DEVICE)
    _sort_kernel[(1,)](x, low, N=n, K=k, DESC=False, FULL=False)
    assert torch.equal(low, x.topk(k, largest=False).values)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n,run", [(16, 4), (64, 64), (64, 1), (256, 32), (2048, 512)])
def test_merge_sort_of_alternating_sorted_runs_matches_torch(dtype, n, run):
    """bitonic_merge_sort skips the stages that sort runs of ``run``: given runs sorted ascending at even
    run indices and descending at odd ones (with duplicates inside and across runs, constant runs like
    padding), its result is torch.sort's; run = n is a no-op, run = 1 the full sort."""
    gen = torch.Generator().manual_seed(n + run)
    x = torch.randint(-50, 50, (n // run, run), generator=gen).to(dtype)
    if n // run > 2:
        x[-1] = 2**31 - 1  # a padding run
    x = x.sort(-1).values
    x[1::2] = x[1::2].flip(-1)
    x = x.flatten().to(DEVICE)
    out = torch.empty(n, dtype=dtype, device=DEVICE)
    _merge_sort_kernel[(1,)](x, out, N=n, RUN=run)
    assert torch.equal(out, x.sort().values)
    if 2 < run < n:  # the odd runs must be reversed: all runs ascending are not merged
        y = x.view(n // run, run).sort(-1).values.flatten().contiguous()
        _merge_sort_kernel[(1,)](y, out, N=n, RUN=run)
        assert not torch.equal(out, y.sort().values)


def test_sort_key_orders_by_score_then_lower_position():
    s = torch.tensor([0.5, -1.0, 3.0, -0.0, 0.0, 3.0, -2.5e-38, float("inf"), -7.0, 1e-40], device=DEVICE)
    p = torch.tensor([10, 11, 12, 13, 14, 9, 15, 16, 17, 18], dtype=torch.int32, device=DEVICE)
    n, N, K = len(s), 16, 16
    key = torch.empty(N, dtype=torch.int64, device=DEVICE)
    top_s = torch.empty(K, dtype=torch.float32, device=DEVICE)
    top_p = torch.empty(K, dtype=torch.int32, device=DEVICE)
    _key_kernel[(1,)](s, p, n, key, top_s, top_p, N=N, K=K)
    # reference order: score descending, then position ascending (-0.0 == 0.0 numerically, but its
    # bit pattern sorts just below +0.0, which is harmless)
    def rank(i):
        x = float(s[i])
        return (-x, x == 0.0 and math.copysign(1.0, x) < 0, int(p[i]))

    order = sorted(range(n), key=rank)
    assert top_p[:n].tolist() == [int(p[i]) for i in order]
    assert torch.equal(top_s[:n], s[order])
    assert (key[n:] == EMPTY.value).all() and (key[:n] > EMPTY.value).all()
