"""dense.py (split-K decode + LSE merge) against float64 softmax attention and the torch FullAttention."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.methods.full import FullAttention
from tests.core.kernels._helpers import DEVICE, make_kv, ref_attend

CASES = [  # (B, H_kv, G, d, lengths, block, dtype)
    (1, 1, 1, 64, [64], None, torch.float32),
    (2, 1, 3, 64, [700, 33], 16, torch.float32),
    (2, 2, 7, 128, [1500, 900], None, torch.float32),
    (2, 1, 7, 128, [300, 1], 32, torch.bfloat16),
    (1, 2, 3, 64, [257], 64, torch.float16),
    (2, 1, 3, 96, [130, 77], 16, torch.float32),  # head dim not a power of two
]


@pytest.mark.parametrize("B,H_kv,G,d,lengths,block,dtype", CASES)
def test_dense_decode_matches_softmax_attention(B, H_kv, G, d, lengths, block, dtype):
    from retopk_core.kernels.triton_launch import dense_decode

    kv, k, v = make_kv(B, H_kv, max(lengths) + 5, d, lengths, dtype, block, seed=B * d + G)
    q = torch.randn(B, H_kv * G, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = 1 / math.sqrt(d)
    out = dense_decode(q.to(DEVICE), kv, scale)
    assert out.shape == (B, H_kv * G, d) and out.dtype == dtype
    ref = ref_attend(q, k, v, lengths, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double().cpu(), ref, atol=tol, rtol=tol)


def test_full_attention_method_triton_equals_torch_backend():
    kv, _, _ = make_kv(2, 2, 400, 64, [400, 150], torch.float32, 16, seed=3)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    a = FullAttention().decode(q, kv, None, None)
    b = FullAttention(backend="triton").decode(q, kv, None, None)
    torch.testing.assert_close(b.out, a.out, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.n_scored, b.n_scored)


def test_dense_decode_many_splits_merge():
    """Force many splits (each a short range, some past a sequence's end) to exercise the LSE merge."""
    from retopk_core.kernels.dense import dense_attention
    from retopk_core.kernels.workspace_cache import Workspace

    kv, k, v = make_kv(2, 1, 600, 64, [600, 70], torch.float32, None, seed=5)
    q = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(4))
    out = dense_attention(q.to(DEVICE), kv, 0.125, Workspace(DEVICE), target_programs=40, block_n=16)
    torch.testing.assert_close(out.double().cpu(), ref_attend(q, k, v, [600, 70], 0.125), atol=1e-5, rtol=1e-5)


def test_dense_decode_below_a_length_limit_computes_only_the_short_rows():
    """below = L_lim (ReTopK's dense floor): the splits cover positions < L_lim only, rows with L_b < L_lim
    equal softmax attention, rows at or above it are left alone (not written)."""
    from retopk_core.kernels.dense import dense_attention
    from retopk_core.kernels.workspace_cache import Workspace

    kv, k, v = make_kv(3, 1, 600, 64, [600, 70, 99], torch.float32, 16, seed=6)
    q = torch.randn(3, 3, 64, generator=torch.Generator().manual_seed(5))
    ws = Workspace(DEVICE)
    out = dense_attention(q.to(DEVICE), kv, 0.125, ws, target_programs=40, block_n=16, below=100)
    ref = ref_attend(q, k, v, [600, 70, 99], 0.125)
    torch.testing.assert_close(out[1:].double().cpu(), ref[1:], atol=1e-5, rtol=1e-5)
    assert ws._bufs["dense_lse"].numel() <= 3 * 3 * 7  # splits over 100 positions, not 600
