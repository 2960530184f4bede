"""exact.py + select_attend.py (the Exact Top-K method) against Top-K and attention from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.methods.exact import ExactTopK, ExactTopKConfig
from tests.kernels._helpers import DEVICE, assert_topk_support, make_kv, ref_attend, ref_scores

CASES = [  # (B, H_kv, G, d, lengths, block, K, chunk, fan)
    (1, 1, 1, 64, [64], None, 4, None, None),
    (2, 1, 3, 64, [700, 40], 16, 16, None, None),
    (2, 1, 7, 128, [1200, 333], 64, 100, 128, 2),  # 10 chunks -> 5 -> 3 -> 2 -> 1: four merge levels
    (2, 2, 3, 64, [20, 90], None, 64, None, None),  # L < K: -1 padding
    (1, 1, 3, 128, [1500], 128, 512, None, None),
    (2, 1, 1, 64, [1100, 600], None, 512, 512, None),  # several chunks with K = 512, one merge
    (1, 1, 3, 96, [150], 16, 24, None, None),  # head dim and K not powers of two
]


@pytest.mark.parametrize("B,H_kv,G,d,lengths,block,K,chunk,fan", CASES)
def test_exact_topk_decode_selects_topk_and_attends(B, H_kv, G, d, lengths, block, K, chunk, fan):
    from retopk_core.kernels.launch import exact_topk_decode

    kv, k, v = make_kv(B, H_kv, max(lengths) + 3, d, lengths, torch.float32, block, seed=K + d)
    q = torch.randn(B, H_kv * G, d, generator=torch.Generator().manual_seed(K))
    scale = 1 / math.sqrt(d)
    out, sel = exact_topk_decode(q.to(DEVICE), kv, K, scale, chunk=chunk, fan=fan)
    assert sel.shape == (B, H_kv * G, K) and sel.dtype == torch.long
    assert_topk_support(sel, ref_scores(q, k, lengths, scale), K)
    ref = ref_attend(q, k, v, lengths, scale, sel)
    torch.testing.assert_close(out.double().cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_method_triton_equals_torch_backend(dtype):
    kv, _, _ = make_kv(2, 2, 500, 64, [500, 260], dtype, 32, seed=9)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(8)).to(dtype).to(DEVICE)
    a = ExactTopK(ExactTopKConfig(top_k=32)).decode(q, kv, None, None)
    b = ExactTopK(ExactTopKConfig(top_k=32), backend="triton").decode(q, kv, None, None)
    assert torch.equal(a.selected.sort(-1).values, b.selected.sort(-1).values)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(b.out.float(), a.out.float(), atol=tol, rtol=tol)
    assert b.out.dtype == dtype and torch.equal(a.path, b.path) and torch.equal(a.n_scored, b.n_scored)


def test_exact_rejects_bad_inputs():
    from retopk_core.kernels.launch import exact_topk_decode

    kv, _, _ = make_kv(1, 1, 32, 64, [32], torch.float32, None)
    with pytest.raises(ValueError, match="head dim"):
        exact_topk_decode(torch.randn(1, 2, 32, device=DEVICE), kv, 4, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        exact_topk_decode(torch.randn(1, 64, 2, device=DEVICE).transpose(1, 2), kv, 4, 1.0)
