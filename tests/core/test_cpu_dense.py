"""The fused CPU kernel's dense steps (``launch.dense_decode``: Full attention, Full attention with each head's
Top-K of the same scores, Exact Top-K attention) against attention written from the definition in float64.

The kernel widens 16-bit keys and values exactly (bf16 -> float32 is a shift) and accumulates in float32, so
a 16-bit KV cache is held to the same float32 tolerance as a float32 one, the reference reading the same
16-bit values; the selected positions must be the reference's Top-K as sets in every dtype.
"""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.cpu import launch
from retopk_core.kv import PagedKV
from retopk_core.methods import make_method
from tests.core._scenario import paged

needs_kernel = pytest.mark.skipif(not launch.available(),
                                  reason="fused CPU kernel not built: run `python -m retopk_core.cpu.build`")

# float32 accumulation over a few hundred terms of O(1) values: a few hundred ulps of the result
TOL = 256 * torch.finfo(torch.float32).eps


def reference(q: torch.Tensor, kv: PagedKV, scale: float, top_k: int, exact: bool):
    """Per (b, h): e = q k^T scale over all L positions, S = TopK e, out = softmax(e) V (or over S only), float64."""
    B, H, _ = q.shape
    G = H // kv.num_kv_heads
    out = torch.zeros(B, H, kv.v_pool.shape[-1], dtype=torch.float64)
    sel = []
    for b in range(B):
        row = []
        for h in range(H):
            keys, values = kv.keys(b, h // G).double(), kv.values(b, h // G).double()  # (L, d)
            e = keys @ q[b, h].double() * scale  # (L,)
            s = torch.topk(e, min(top_k, e.numel())).indices if top_k else None
            if exact:
                out[b, h] = torch.softmax(e[s], 0) @ values[s]
            else:
                out[b, h] = torch.softmax(e, 0) @ values
            row.append(set(s.tolist()) if top_k else None)
        sel.append(row)
    return out, sel


def case(B: int, H: int, H_kv: int, d: int, lengths: list[int], block: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    L_cap = max(lengths)
    keys = torch.randn(B, H_kv, L_cap, d, generator=g).to(dtype).float()
    values = torch.randn(B, H_kv, L_cap, d, generator=g).to(dtype).float()
    kv = paged(keys, values, torch.tensor(lengths), block=block, seed=seed)
    kv = PagedKV(kv.k_pool.to(dtype), kv.v_pool.to(dtype), kv.block_table, kv.lengths)
    return torch.randn(B, H, d, generator=g), kv


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["full", "full+topk", "exact"])
@pytest.mark.parametrize("shape", [(2, 4, 4, 16, 16), (3, 9, 3, 64, 256), (2, 14, 2, 24, 100)],
                         ids=["mha", "gqa3", "gqa7-d24-block100"])
def test_dense_decode_matches_the_definition(dtype, mode, shape):
    B, H, H_kv, d, block = shape
    lengths = [5, 300, 37][:B]  # shorter than K (5 < 16), several blocks, a partial block
    q, kv = case(B, H, H_kv, d, lengths, block, dtype, seed=H + d)
    scale = 1 / math.sqrt(d)
    top_k = 0 if mode == "full" else 16
    out, sel = launch.dense_decode(q, kv, scale, top_k, exact=mode == "exact")
    ref_out, ref_sel = reference(q, kv, scale, top_k, mode == "exact")
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(out.double(), ref_out, atol=TOL, rtol=TOL)
    if top_k:
        assert sel.shape == (B, H, top_k) and sel.dtype == torch.long
        for b in range(B):
            for h in range(H):
                row = sel[b, h].tolist()
                assert set(p for p in row if p >= 0) == ref_sel[b][h]
                assert row.count(-1) == max(0, top_k - lengths[b])
    else:
        assert sel is None


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [100, 256])
def test_full_attention_split_along_the_keys_matches_the_definition_and_not_its_batch(dtype, block):
    """Full attention runs in parts of 512 keys merged by their maxima: lengths across one, two and several
    parts (a part boundary inside a block for block 100) equal the float64 definition, and each row's output
    is the same bits alone as in the batch (the parts depend on L, never on the batch)."""
    lengths = [1500, 513, 512, 7]
    q, kv = case(len(lengths), 9, 3, 64, lengths, block, dtype, seed=block)
    out, _ = launch.dense_decode(q, kv, 0.125)
    ref_out, _ = reference(q, kv, 0.125, 0, False)
    torch.testing.assert_close(out.double(), ref_out, atol=TOL, rtol=TOL)
    for b in range(len(lengths)):
        one = PagedKV(kv.k_pool, kv.v_pool, kv.block_table[b:b + 1], kv.lengths[b:b + 1])
        assert torch.equal(launch.dense_decode(q[b:b + 1], one, 0.125)[0], out[b:b + 1])


@needs_kernel
@pytest.mark.parametrize("name,params", [("full", {}), ("exact_topk", {"top_k": 16})])
def test_methods_on_the_cpu_backend_take_the_kernel_and_equal_their_torch_code(name, params):
    q, kv = case(2, 9, 3, 64, [300, 40], 256, torch.bfloat16, seed=5)
    a = make_method(name, backend="torch", **params).decode(q, kv, None, torch.tensor([0, 1]))
    b = make_method(name, backend="cpu", **params).decode(q, kv, None, torch.tensor([0, 1]))
    torch.testing.assert_close(b.out, a.out, atol=TOL, rtol=TOL)
    assert torch.equal(a.path, b.path) and torch.equal(a.n_scored, b.n_scored)
    if params:
        assert [set(r.tolist()) for r in b.selected.view(-1, 16)] == [set(r.tolist()) for r in a.selected.view(-1, 16)]
    assert make_method(name, backend="cpu", **params).describe()["backend"] == "cpu"


@needs_kernel
def test_dense_decode_checks_name_the_culprit():
    q, kv = case(1, 4, 2, 16, [10], 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="lengths\\[0\\] = 99"):
        launch.dense_decode(q, PagedKV(kv.k_pool, kv.v_pool, kv.block_table, torch.tensor([99])), 0.25)
    with pytest.raises(ValueError, match="top_k must be"):
        launch.dense_decode(q, kv, 0.25, 0, exact=True)
