"""The decoder's weight formats, their CPU kernels and the GGUF reader, against independent references: gguf's
own dequantization, transformers' GGUF loader (the embedded model's float32 weights), float64 matmuls and
torch's RMSNorm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from retopk_core.cpu import decoder_ops
from retopk_core.models import DEFAULT_MODEL, resolve_model
from retopk_server.runtime.decoder.linear import (
    NEVER,
    Int4Linear,
    Int8Linear,
    float_matmul,
    from_float,
    packed,
    wide_dtype,
    wide_rows,
)
from retopk_server.runtime.decoder.load import GGUFTensors, _q4_blocks, _q8_blocks, from_gguf


def embedded_gguf() -> str:
    source = resolve_model(DEFAULT_MODEL)
    return f"{source.path}/{source.gguf_file}"


@pytest.fixture(scope="module")
def gguf_config():
    from transformers import AutoConfig

    source = resolve_model(DEFAULT_MODEL)
    return AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)


def test_q4_1_q4_0_and_q8_0_blocks_decode_as_gguf_dequantizes_them(gguf_config):
    """Our Int4 / Int8 readings of a file's blocks dequantize to exactly what gguf's own dequantize gives:
    Q4_1 and Q8_0 from the embedded file, Q4_0 (m = -8 d) from random blocks."""
    from gguf import GGMLQuantizationType, dequantize

    g = GGUFTensors(embedded_gguf(), gguf_config)
    t = g.tensors["blk.0.ffn_down.weight"]  # Q4_1, rows as stored (no Q/K permutation)
    assert t.tensor_type.name == "Q4_1"
    data = np.asarray(t.data)
    lin = Int4Linear(*_q4_blocks(data, "Q4_1"))
    theirs = torch.from_numpy(np.array(dequantize(data, t.tensor_type)))
    assert torch.equal(lin.dequantized(), theirs.view(lin.out_features, -1))
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(8, 4, 18), dtype=np.uint8)
    blocks[..., :2] = np.float16(rng.normal(0, 0.01, size=(8, 4, 1))).view(np.uint8)
    q4_0 = blocks.reshape(8, -1)
    theirs = torch.from_numpy(np.array(dequantize(q4_0, GGMLQuantizationType.Q4_0))).view(8, -1)
    assert torch.equal(Int4Linear(*_q4_blocks(q4_0, "Q4_0")).dequantized(), theirs)
    e = g.tensors["token_embd.weight"]  # Q8_0
    data = np.asarray(e.data)[:64]
    lin8 = Int8Linear(*_q8_blocks(data))
    assert torch.equal(lin8.dequantized(), torch.from_numpy(np.array(dequantize(data, e.tensor_type))).view(64, -1))


@pytest.mark.slow
def test_gguf_weights_as_stored_equal_transformers_loader(embedded_model, gguf_config):
    """Every matmul weight, read as float32 or kept in its blocks, equals transformers' dequantized one (the
    Q/K row permutation undone); the tied Q8_0 table serves the embedding and the LM head alike."""
    model, _ = embedded_model
    exact = from_gguf(embedded_gguf(), gguf_config, "float32")
    stored = from_gguf(embedded_gguf(), gguf_config, "as-stored")
    assert stored.weight_format == "int4, lm_head int8" and exact.weight_format == "float32, lm_head float32"
    assert stored.weight_bytes < exact.weight_bytes / 5
    for i in (0, 17, 29):
        a, m = model.model.layers[i].self_attn, model.model.layers[i].mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach()
        assert torch.equal(exact.layers[i].qkv.weight, qkv)
        assert torch.equal(exact.layers[i].gate_up.weight, gate_up)
        assert torch.equal(stored.layers[i].qkv.dequantized(), qkv)
        assert torch.equal(stored.layers[i].down.dequantized(), m.down_proj.weight.detach())
    torch.testing.assert_close(exact.lm_head.weight, model.lm_head.weight.detach(), rtol=0, atol=0)
    assert torch.equal(stored.lm_head.dequantized(), model.lm_head.weight.detach())
    ids = torch.tensor([0, 7, 49151])
    assert torch.equal(stored.embed(ids), model.model.embed_tokens.weight.detach()[ids])


def _levels() -> list[int]:
    return list(range(decoder_ops.best_isa() + 1)) if decoder_ops.available() else []


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_quantization_rounds_to_the_nearest_stored_step(cls):
    """Quantizing a float weight: every weight within half a step of the block's grid, plus the float16
    rounding of the block's scale (and minimum) the grid is built on."""
    torch.manual_seed(0)
    w = torch.randn(48, 128)
    lin = from_float(w, None, cls)
    assert isinstance(lin, Int4Linear if cls == "int4" else Int8Linear)
    blocks = w.double().unflatten(1, (-1, 32))
    err = (lin.dequantized().double().unflatten(1, (-1, 32)) - blocks).abs().amax(-1)  # (out, in/32)
    f16 = torch.finfo(torch.float16).eps
    if cls == "int4":
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        d = (hi - lo) / 15
        bound = d * (0.5 + 16 * f16) + lo.abs() * f16
    else:
        d = blocks.abs().amax(-1) / 127
        bound = d * (0.5 + 128 * f16)
    assert (err <= bound + 1e-12).all()


@pytest.mark.parametrize("cls", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, wide_rows(wide_dtype(), "float32") - 1])
def test_block_matmul_equals_the_float64_product_at_every_simd_level(cls, rows):
    """y = x W^T + b + residual through the block kernel equals a float64 product with the dequantized
    weights within float32 rounding of its sums, on every SIMD level this CPU has (plain, AVX2, AVX-512, whose
    loops AVX-512 VNNI's level runs for float32 activations),
    for a batch that fills the kernel's row passes and one that does not."""
    levels = _levels()
    if not levels:
        pytest.skip("the fused CPU library is not built")
    torch.manual_seed(rows)
    w, b = torch.randn(80, 192), torch.randn(80)
    lin = from_float(w, b, cls)
    x, res = torch.randn(rows, 192), torch.randn(rows, 80)
    ref_w = lin.dequantized().double()
    ref = x.double() @ ref_w.T + b.double() + res.double()
    scale = x.abs().double() @ ref_w.abs().T + b.abs().double() + res.abs().double()
    f32 = torch.finfo(torch.float32).eps
    for level in levels:
        y = decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, res, level)
        assert y.dtype == torch.float32 and y.shape == (rows, 80)
        assert ((y.double() - ref).abs() <= 8 * f32 * scale).all(), f"isa level {level}"
    assert torch.equal(lin(x, residual=res), decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, res))


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_block_matmul_rows_do_not_depend_on_their_batch(cls):
    """Each row of a batch is bit for bit the row multiplied alone, at every SIMD level: a request's tokens
    do not depend on the requests it is batched with."""
    levels = _levels()
    if not levels:
        pytest.skip("the fused CPU library is not built")
    torch.manual_seed(3)
    lin = from_float(torch.randn(48, 160), torch.randn(48), cls)
    x = torch.randn(wide_rows(wide_dtype(), "float32") - 1, 160)
    for level in levels:
        batch = decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, None, level)
        for i in range(x.shape[0]):
            alone = decoder_ops.block_matmul(x[i:i + 1], lin.qs, lin.scales, lin.bits, lin.bias, None, level)
            assert torch.equal(batch[i:i + 1], alone), (level, i)


@pytest.mark.parametrize("cls", ["int4", "int8"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("n_in", [32, 96, 2080])
def test_every_batch_size_gives_each_row_its_one_row_result(cls, activations, n_in):
    """Batches of 1 to 17 rows (one and two passes of 4 or 8 rows, full or not, as the SIMD level's loops take
    them) over 1, 3 and 65 blocks (an odd count; 65 spans two chunks of widened scales): every row bit for bit
    the row alone, whose one-row loop the pass width does not touch, at every SIMD level; with float32
    activations, also within float32 rounding of the float64 product with the dequantized weights."""
    levels = _levels()
    if not levels:
        pytest.skip("the fused CPU library is not built")
    torch.manual_seed(n_in)
    lin = from_float(torch.randn(21, n_in) * 0.1, torch.randn(21), cls)
    ref_w = lin.dequantized().double()
    f32 = torch.finfo(torch.float32).eps
    for rows in range(1, 18):
        x = torch.randn(rows, n_in)
        ref = x.double() @ ref_w.T + lin.bias.double()
        scale = x.abs().double() @ ref_w.abs().T + lin.bias.abs().double()
        for level in levels:
            batch = decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, None, level, activations)
            for i in range(rows):
                alone = decoder_ops.block_matmul(x[i:i + 1], lin.qs, lin.scales, lin.bits, lin.bias, None, level,
                                                 activations)
                assert torch.equal(batch[i:i + 1], alone), (rows, level, i)
            if activations == "float32":
                assert ((batch.double() - ref).abs() <= 8 * f32 * scale).all(), (rows, level)


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_prefill_rows_multiply_through_the_wide_copy_in_its_dtype(cls):
    """From wide_rows(dtype, activations) rows on, the product runs through the dequantized copy: within bfloat16
    rounding of x and y in bfloat16, within float32 rounding once the copy is float32 (the float32 KV configuration)."""
    torch.manual_seed(1)
    w, b = torch.randn(64, 96), torch.randn(64)
    lin = from_float(w, b, cls)
    x = torch.randn(max(wide_rows(dtype, lin.activations) for dtype in (torch.bfloat16, torch.float32)) + 3, 96)
    ref_w = lin.dequantized().double()
    ref = x.double() @ ref_w.T + b.double()
    scale = x.abs().double() @ ref_w.abs().T + b.abs().double()
    for dtype in (torch.bfloat16, torch.float32):
        eps = torch.finfo(dtype).eps
        lin.set_wide_dtype(dtype)
        assert lin.wide.dtype == dtype
        assert ((lin(x).double() - ref).abs() <= 8 * eps * scale).all()


@pytest.mark.parametrize("rows", [16, 48, 394])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bfloat16_copy_multiplies_as_torch_linear_bit_for_bit(rows, with_bias):
    """A bfloat16 wide copy is held in oneDNN's packed layout where torch has that path, and its GEMM (+ bias)
    (+ residual) equals torch's ``linear`` on the plain bfloat16 copy bit for bit, y widened to float32 before
    the sums, at a single prompt's rows and at a prefill wave's. Elsewhere ``packed`` returns the copy as it
    is."""
    torch.manual_seed(rows)
    lin = from_float(torch.randn(96, 160), torch.randn(96) if with_bias else None, "int4")
    lin.set_wide_dtype(torch.float32)
    assert not lin.wide.is_mkldnn  # float32 copies stay plain
    x48, acc = torch.randn(48, 160), torch.randn(48, 96)
    want = lin(x48, residual=acc)  # a new tensor
    assert lin(x48, residual=acc, into=True) is acc and torch.equal(acc, want)  # the same sum, into the residual
    lin.set_wide_dtype(torch.bfloat16)
    plain = lin.dequantized().to(torch.bfloat16)  # (96, 160)
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert lin.wide.is_mkldnn == onednn and packed(torch.ones(2, 2)).is_mkldnn is False
    if not onednn:
        pytest.skip("this torch or CPU has no oneDNN bfloat16 GEMM")
    assert lin.wide.dtype == torch.bfloat16 and tuple(lin.wide.shape) == (96, 160)
    assert torch.equal(lin.wide.to_dense(), plain)
    x, res = torch.randn(rows, 160), torch.randn(rows, 96)
    y = torch.nn.functional.linear(x.to(torch.bfloat16), plain).float()  # (rows, 96)
    if with_bias:
        y = y + lin.bias
    assert torch.equal(float_matmul(x, lin.wide, lin.bias), y)
    assert torch.equal(float_matmul(x, lin.wide, lin.bias, res), y + res)
    assert torch.equal(lin(x, residual=res), y + res)
    narrow = lin(x, widen=False)  # y as the GEMM gives it: bfloat16 without a bias, widened by adding one
    assert narrow.dtype == (torch.float32 if with_bias else torch.bfloat16) and torch.equal(narrow.float(), y)


def _on_blocks(lin, x: torch.Tensor, residual: torch.Tensor | None, activations: str) -> torch.Tensor:
    """The block kernel's own product of ``lin`` with ``activations`` (what its rule's block side must equal)."""
    b = lin.blocks
    return decoder_ops.block_matmul(x, b.qs, b.scales, b.bits, b.bias, residual, activations=activations)


@pytest.mark.parametrize("cls", ["int4", "int8"])
@pytest.mark.parametrize(("dtype", "activations"), [(torch.float32, "float32"), (torch.bfloat16, "float32"),
                                                    (torch.float16, "float32"), (torch.float32, "int16")])
def test_rows_below_the_wide_rule_take_the_blocks_and_from_it_the_copy(cls, dtype, activations):
    """The rule per (wide dtype, activations) where it ends: up to wide_rows(dtype, activations) - 1 rows the product
    is the block kernel's with those activations bit for bit, from wide_rows(dtype, activations) on the wide copy's
    GEMM bit for bit (each a different sum, so neither equals the other by chance)."""
    if not decoder_ops.available():
        pytest.skip("the fused CPU library is not built")
    torch.manual_seed(5)
    lin = from_float(torch.randn(48, 128), torch.randn(48), cls)  # 48 outputs: int16's units of 16
    lin.set_wide_dtype(dtype)
    lin.set_activations(activations)
    n = wide_rows(dtype, activations)
    assert n < NEVER
    for rows in (n - 1, n):
        x, res = torch.randn(rows, 128), torch.randn(rows, 48)
        blocks = _on_blocks(lin, x, res, activations)
        wide = float_matmul(x, lin.wide, lin.bias, res)
        assert not torch.equal(blocks, wide)
        assert torch.equal(lin(x, residual=res), blocks if rows < n else wide), rows


@pytest.mark.parametrize("cls", ["int4", "int8"])
@pytest.mark.parametrize(("dtype", "activations"), [(torch.bfloat16, "int16"), (torch.float16, "int16"),
                                                    (None, "int16"), (None, "float32")])
def test_int16_against_a_16_bit_copy_and_no_copy_take_the_blocks_at_every_row_count(cls, dtype, activations):
    """int16 activations against a bfloat16 or float16 copy (a 16-bit KV cache's prefill), and any activations with no
    copy (dtype None, "the blocks"): from 1 row to a prefill chunk's and a wave's the product is the block kernel's
    with those activations bit for bit (the copy's GEMM sums otherwise: checked against it at each row count), and
    the copy is never made, not by a product nor by hold_wide."""
    if not decoder_ops.available():
        pytest.skip("the fused CPU library is not built")
    torch.manual_seed(6)
    lin = from_float(torch.randn(48, 128), torch.randn(48), cls)  # 48 outputs: int16's units of 16
    lin.set_wide_dtype(dtype)
    lin.set_activations(activations)
    lin.hold_wide()
    assert wide_rows(dtype, activations) == NEVER and lin.wide_nbytes == 0
    other = (dtype or torch.bfloat16) if activations == "int16" else torch.float32  # a copy it might have taken
    gemm = packed(lin.dequantized().to(other))
    for rows in (1, 17, 96, 97, 512, 1030):
        x, res = torch.randn(rows, 128), torch.randn(rows, 48)
        blocks = _on_blocks(lin, x, res, activations)
        assert not torch.equal(blocks, float_matmul(x, gemm, lin.bias, res))
        assert torch.equal(lin(x, residual=res), blocks), rows
        assert torch.equal(lin(x), _on_blocks(lin, x, None, activations)), rows
    assert lin.wide_nbytes == 0


def test_a_copy_is_made_on_first_use_or_by_hold_wide_and_let_go_with_its_dtype():
    """The wide copy is made by the first product that takes it, or ahead by hold_wide where the rule will use it
    (in the held dtype, its bytes counted by wide_nbytes); set_wide_dtype lets it go (the next one made in the new
    dtype), hold_wide lets go of one the rule will not use; None without the fused CPU library is refused."""
    lin = from_float(torch.randn(48, 128), None, "int4")
    assert lin.wide_nbytes == 0 and lin.wide_dtype == wide_dtype()
    lin(torch.randn(wide_rows(wide_dtype(), "float32"), 128))
    assert lin.wide_nbytes == 48 * 128 * torch.finfo(wide_dtype()).bits // 8
    lin.set_wide_dtype(torch.float32)
    assert lin.wide_nbytes == 0
    lin.hold_wide()
    assert lin.wide_nbytes == 48 * 128 * 4 and lin.wide.dtype == torch.float32
    assert torch.equal(lin.wide, lin.dequantized())
    if decoder_ops.available():
        lin.set_wide_dtype(torch.bfloat16)
        assert lin.wide.dtype == torch.bfloat16 and lin.wide_nbytes > 0  # made on first use
        lin.set_activations("int16")
        lin.hold_wide()
        assert lin.wide_nbytes == 0
    else:
        with pytest.raises(ValueError, match="not built"):
            lin.set_wide_dtype(None)


def test_block_matmul_refuses_what_it_cannot_read():
    """The kernel's entry names the argument: a wrong dtype, a shape that is not blocks of 32, an ISA the CPU lacks."""
    if not decoder_ops.available():
        pytest.skip("the fused CPU library is not built")
    lin = from_float(torch.randn(32, 64), None, "int4")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="x must be"):
        decoder_ops.block_matmul(x.double(), lin.qs, lin.scales, 4)
    with pytest.raises(ValueError, match="qs must be"):
        decoder_ops.block_matmul(x, lin.qs.view(torch.int8), lin.scales, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        decoder_ops.block_matmul(torch.randn(2, 48), lin.qs, lin.scales, 4)
    with pytest.raises(ValueError, match="residual"):
        decoder_ops.block_matmul(x, lin.qs, lin.scales, 4, None, torch.randn(3, 32))
    with pytest.raises(ValueError, match="isa"):
        decoder_ops.block_matmul(x, lin.qs, lin.scales, 4, None, None, decoder_ops.best_isa() + 1)


def test_rms_norm_kernel_equals_torch():
    """The library's RMSNorm equals torch's within float32 rounding, for a decode row and a prefill chunk."""
    if not decoder_ops.available():
        pytest.skip("the fused CPU library is not built")
    torch.manual_seed(2)
    w = torch.randn(576)
    for rows in (1, 300):
        x = torch.randn(rows, 576) * 3
        torch.testing.assert_close(decoder_ops.rms_norm(x, w, 1e-5), torch.rms_norm(x, (576,), w, 1e-5),
                                   rtol=4 * torch.finfo(torch.float32).eps, atol=1e-6)


@pytest.mark.slow
def test_gguf_tokenizer_is_converted_once_and_read_back_the_same(tmp_path, monkeypatch):
    """The tokenizer built from the GGUF's vocabulary is saved under $XDG_CACHE_HOME and a second load reads
    it back: same ids for the same texts, same chat template rendering."""
    from pathlib import Path

    from retopk_server.runtime.loading import gguf_tokenizer, tokenizer_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gguf = Path(embedded_gguf())
    converted = gguf_tokenizer(gguf)
    cache = tokenizer_cache(gguf)
    assert (cache / "tokenizer.json").is_file() and str(cache).startswith(str(tmp_path))
    assert not list(cache.parent.glob("*.tmp*"))
    cached = gguf_tokenizer(gguf)
    texts = ["The capital of France is Paris.", "  indented\tcode = {'a': 1}\n", "naïve café – 東京 🙂"]
    for text in texts:
        assert cached.encode(text) == converted.encode(text)
    chat = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        converted.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert cached.eos_token_id == converted.eos_token_id
