"""The decoder ops that split a decode step's few rows across the team (swiglu by columns too, store_kv by pool
row, the layer halves around them) on two threads: each row is bit for bit what it is alone on one thread, and
store_kv writes what torch's cast and index_copy_ write. The runtime tests' fixture runs one thread; these ask
for two, so that the splits happen (the shapes are above the ops' grains)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retopk_core.cpu import decoder_ops
from retopk_server.runtime.decoder import llama
from retopk_server.runtime.decoder.linear import SPLIT_ROWS, float_matmul, from_float, packed
from retopk_server.runtime.kv_pool import to_pool_dtype

pytestmark = pytest.mark.skipif(not decoder_ops.available(), reason="the fused CPU library is not built")

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def two_threads():
    torch.set_num_threads(2)  # the autouse one_torch_thread fixture restores the count afterwards
    yield


def _one_thread(fn, *args):
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(2)


@pytest.mark.parametrize("rows, F_", [(8, 1536), (5, 1000), (3, 1500)])  # halves split a row mid-way but (8, 1536)
def test_swiglu_rows_on_two_threads_are_their_one_thread_rows(two_threads, rows, F_):
    torch.manual_seed(rows)
    gu = torch.randn(rows, 2 * F_) * 6
    batch = decoder_ops.swiglu(gu)
    assert torch.equal(batch, _one_thread(decoder_ops.swiglu, gu))
    for i in range(rows):
        assert torch.equal(batch[i:i + 1], _one_thread(decoder_ops.swiglu, gu[i:i + 1])), i
    g, u = gu.double().chunk(2, dim=-1)
    torch.testing.assert_close(batch, (F.silu(g) * u).float(), rtol=4 * EPS32, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, T", [(8, 1), (2, 7)])
def test_store_kv_on_two_threads_writes_what_torch_casts_and_copies(two_threads, dtype, B, T):
    """A step's keys and values as the whole step passes them (strided views of the QKV rows) into pools of every
    dtype at scattered rows: each pool equals torch's ``index_copy_`` of the torch path's cast (``to_pool_dtype``:
    round to nearest even, float16 saturated at ±65504; values beyond it and a NaN among them), every other row
    untouched."""
    H, H_kv, d, P = 9, 3, 64, 16
    torch.manual_seed(B * T)
    qkv = torch.randn(B, T, H + 2 * H_kv, d).transpose(1, 2)  # (B, heads, T, d), strided as decode_layers' views
    qkv[0, H:, 0, :5] = torch.tensor([7e4, -65520.0, 65519.0, float("inf"), float("nan")])  # a key's and a value's
    k, v = qkv[:, H:H + H_kv], qkv[:, H + H_kv:]
    blocks = B * T  # room for every (b, t) in its own place
    k_pool, v_pool = (torch.randn(blocks, H_kv, P, d).to(dtype) for _ in range(2))
    rows = torch.randperm(blocks * H_kv * P)[:B * H_kv * T].view(B, H_kv, T)
    want = []
    for pool, src in ((k_pool, k), (v_pool, v)):
        ref = pool.clone()
        ref.view(-1, d).index_copy_(0, rows.reshape(-1), to_pool_dtype(src, dtype).reshape(-1, d))
        want.append(ref)
    decoder_ops.store_kv(k_pool, v_pool, rows, k, v)
    for got, ref in zip((k_pool, v_pool), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("activations", decoder_ops.ACTIVATIONS)
def test_layer_halves_on_two_threads_give_each_row_its_one_thread_row(two_threads, activations):
    """attn_in and mlp_out over 8 rows with an MLP of 1536 (swiglu splits) on two threads: each row equals the
    row alone on one thread."""
    if activations == "bf16x2" and not decoder_ops.amx_available():
        pytest.skip("bf16x2 needs AMX-BF16, which this CPU has not")
    H, H_kv, d, D, FF, rows = 6, 2, 32, 192, 1536, 8
    torch.manual_seed(2)
    out = (H + 2 * H_kv) * d
    layer = llama.LayerWeights(attn_norm=torch.rand(D) + 0.5, qkv=from_float(torch.randn(out, D) * 0.05, None, "int4"),
                               o=from_float(torch.randn(D, H * d) * 0.05, None, "int4"), mlp_norm=torch.rand(D) + 0.5,
                               gate_up=from_float(torch.randn(2 * FF, D) * 0.05, None, "int4"),
                               down=from_float(torch.randn(D, FF) * 0.05, None, "int8"))
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        lin.set_activations(activations)
    x, a = torch.randn(rows, D) * 2, torch.randn(rows, H * d)
    angle = torch.rand(rows, d // 2).repeat(1, 2) * 6
    cos, sin = angle.cos().contiguous(), angle.sin().contiguous()

    def attn_in(r):
        return decoder_ops.attn_in(x[r], layer.attn_norm, 1e-5, layer.qkv.blocks, cos[r], sin[r], H + H_kv, d,
                                   activations)

    def mlp_out(r):
        return decoder_ops.mlp_out(x[r], a[r], layer.o.blocks, layer.mlp_norm, 1e-5, layer.gate_up.blocks,
                                   layer.down.blocks, activations)

    for half in (attn_in, mlp_out):
        batch = half(slice(None))
        for i in range(rows):
            assert torch.equal(batch[i:i + 1], _one_thread(half, slice(i, i + 1))), (half.__name__, i)


def test_bf16x2_product_past_the_kept_scratch_gives_each_row_its_one_row_result(two_threads):
    """More rows than the limbs' kept buffer holds (2 M in > 2^18 values: a prefill's size, its own buffer) give
    each row what it gets alone."""
    if not decoder_ops.amx_available():
        pytest.skip("bf16x2 needs AMX-BF16, which this CPU has not")
    torch.manual_seed(4)
    lin = from_float(torch.randn(32, 1024) * 0.05, torch.randn(32), "int4")
    lin.set_activations("bf16x2")
    b = lin.blocks
    x = torch.randn(130, 1024)
    batch = decoder_ops.block_matmul(x, b.qs, b.scales, b.bits, b.bias, None, activations="bf16x2")
    for i in (0, 7, 8, 64, 129):
        alone = decoder_ops.block_matmul(x[i:i + 1], b.qs, b.scales, b.bits, b.bias, None, activations="bf16x2")
        assert torch.equal(batch[i:i + 1], alone), i


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@pytest.mark.parametrize("rows, out, n_in", [(394, 576, 576), (394, 576, 1536), (37, 96, 160), (1, 64, 64)])
def test_packed_product_split_by_rows_is_each_parts_onednn_product(two_threads, rows, out, n_in):
    """packed_linear_rows on two threads: rows 0 .. M / 2 - 1 and M / 2 .. M - 1 are oneDNN's product of those rows
    alone on one thread, bit for bit (one row: one part), and the whole is within bfloat16 rounding of the float64
    product; a prefill wave's o and down shapes among them. float_matmul takes that path on several threads for a
    weight whose out features are at most its in features from SPLIT_ROWS rows a thread, and one oneDNN call else."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("this torch or CPU has no oneDNN bfloat16 GEMM")
    torch.manual_seed(rows + out)
    w = torch.randn(out, n_in).to(torch.bfloat16)
    wp = packed(w)
    x = torch.randn(rows, n_in).to(torch.bfloat16)
    y = decoder_ops.packed_linear_rows(x, wp)
    half = rows // 2
    parts = [slice(0, rows)] if rows == 1 else [slice(0, half), slice(half, rows)]
    for part in parts:
        assert torch.equal(y[part], _one_thread(_onednn_linear, x[part], wp)), part
    ref, scale = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert ((y.double() - ref).abs() <= 2 * torch.finfo(torch.bfloat16).eps * scale).all()
    xf = x.float()
    split = rows >= 2 * SPLIT_ROWS
    assert torch.equal(float_matmul(xf, wp, None), y.float() if split else _onednn_linear(x, wp).float())
    taller = packed(torch.randn(n_in + 32, n_in).to(torch.bfloat16))  # out features above in features: one call
    assert torch.equal(float_matmul(xf, taller, None), _onednn_linear(x, taller).float())


@pytest.mark.parametrize("H, H_kv", [(9, 3), (4, 4)])
def test_segments_causal_attention_on_two_threads_is_each_segments_sdpa(two_threads, H, H_kv):
    """causal_attention_segments_ over ragged segments of a wave's token axis (q, k, v strided as the layer's views of
    its QKV rows), one segment per thread: each segment's rows are torch's causal SDPA of its rows alone, bit for
    bit; rows outside the segments are left as they were; a segment past the rows is refused."""
    d, lengths = 64, [43, 50, 1, 49, 54]
    offsets = [sum(lengths[:i]) + 2 for i in range(len(lengths))]  # rows 0, 1 belong to no segment
    N = offsets[-1] + lengths[-1]
    torch.manual_seed(H)
    qkv = torch.randn(N, H + 2 * H_kv, d).view(1, N, H + 2 * H_kv, d).transpose(1, 2)  # (1, heads, N, d)
    q, k, v = qkv[:, :H], qkv[:, H:H + H_kv], qkv[:, H + H_kv:]
    out = torch.full((1, N, H, d), 7.0)
    decoder_ops.causal_attention_segments_(out, q, k, v, offsets, lengths, 0.125)
    for a, T in zip(offsets, lengths, strict=True):
        rows = slice(a, a + T)
        want = F.scaled_dot_product_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], is_causal=True, scale=0.125,
                                              enable_gqa=H != H_kv)  # (1, H, T, d)
        assert torch.equal(out[:, rows], want.transpose(1, 2)), a
    assert (out[:, :2] == 7).all()
    with pytest.raises(ValueError, match="outside"):
        decoder_ops.causal_attention_segments_(out, q, k, v, [N - 3], [4], 0.125)
