"""exact_support.py + select_attend.py (the Exact Top-K method) against Top-K and attention from the definition."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.methods.exact import ExactTopK, ExactTopKConfig
from tests.core.kernels._helpers import DEVICE, assert_topk_support, make_kv, ref_attend, ref_scores

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
    from retopk_core.kernels.triton_launch import exact_topk_decode

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
    from retopk_core.kernels.triton_launch import exact_topk_decode

    kv, _, _ = make_kv(1, 1, 32, 64, [32], torch.float32, None)
    with pytest.raises(ValueError, match="head dim"):
        exact_topk_decode(torch.randn(1, 2, 32, device=DEVICE), kv, 4, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        exact_topk_decode(torch.randn(1, 64, 2, device=DEVICE).transpose(1, 2), kv, 4, 1.0)


def test_exact_keys_for_heads_off_reuse_only_from_a_device_work_list():
    """With a path (ReTopK), the work lists name exactly the heads whose path is not REUSE and their KV
    groups, those heads get the exact Top-K (four merge levels over persistent grids), and a step where
    every head reuses writes nothing."""
    from retopk_core.kernels.bitonic import EMPTY
    from retopk_core.kernels.exact_support import exact_topk_keys
    from retopk_core.kernels.workspace_cache import Workspace

    B, H_kv, G, d, K, lengths = 2, 2, 2, 64, 8, [300, 70]
    kv, k, _ = make_kv(B, H_kv, 300, d, lengths, torch.float32, 16, seed=5)
    q = torch.randn(B, H_kv * G, d, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    scale = 1 / math.sqrt(d)
    path = torch.tensor([[0, 1, 0, 0], [3, 0, 2, 2]], dtype=torch.int8, device=DEVICE)
    ws = Workspace(DEVICE)
    keys = exact_topk_keys(q, kv, K, scale, ws, path=path, chunk=32, fan=2).cpu()  # 10 -> 5 -> 3 -> 2 -> 1 lists
    n = ws.get("exact_n_work", (2,), torch.int32).tolist()
    assert n == [4, 3]
    assert ws.get("exact_heads", (B * 4,), torch.int32)[:4].tolist() == [1, 4, 6, 7]
    assert ws.get("exact_groups", (B * H_kv,), torch.int32)[:3].tolist() == [0, 2, 3]
    sel = torch.where(keys == EMPTY.value, -1, 0x7FFFFFFF - (keys & 0xFFFFFFFF))[..., :K]  # (B, H, K) positions
    scores = ref_scores(q.cpu(), k, lengths, scale)
    for b, h in ((0, 1), (1, 0), (1, 2), (1, 3)):
        assert_topk_support(sel[b:b + 1, h:h + 1], [scores[b][h:h + 1]], K)
    out = exact_topk_keys(q, kv, K, scale, ws, path=path, chunk=32, fan=2)
    out.fill_(7)
    exact_topk_keys(q, kv, K, scale, ws, path=torch.zeros_like(path), chunk=32, fan=2)
    assert ws.get("exact_n_work", (2,), torch.int32).tolist() == [0, 0]
    assert (out == 7).all()
