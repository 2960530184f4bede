"""The decode step's fused layer halves (decoder_ops.attn_in / mlp_out) against the ops they fuse, called one by
one, and swiglu against float64; then a whole model's decode with the fused path on and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from retopk_core.cpu import decoder_ops
from retopk_server.runtime.decoder import llama
from retopk_server.runtime.decoder.linear import NEVER, from_float, wide_dtype, wide_rows

pytestmark = pytest.mark.skipif(not decoder_ops.available(), reason="the fused CPU library is not built")

EPS32 = torch.finfo(torch.float32).eps
H, H_KV, D_HEAD, D, FF = 6, 2, 32, 192, 320  # a small GQA layer: q heads, kv heads, head dim, model dim, MLP dim


def _layer(fmt: str, qkv_bias: bool) -> llama.LayerWeights:
    torch.manual_seed(0)
    out = (H + 2 * H_KV) * D_HEAD
    bias = torch.randn(out) if qkv_bias else None
    return llama.LayerWeights(attn_norm=torch.rand(D) + 0.5, qkv=from_float(torch.randn(out, D) * 0.05, bias, fmt),
                              o=from_float(torch.randn(D, H * D_HEAD) * 0.05, None, fmt), mlp_norm=torch.rand(D) + 0.5,
                              gate_up=from_float(torch.randn(2 * FF, D) * 0.05, None, fmt),
                              down=from_float(torch.randn(D, FF) * 0.05, None, fmt))


def _rope(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(rows, D_HEAD // 2).repeat(1, 2) * 6  # (rows, d), the two halves share an angle as in RoPE
    return angle.cos().contiguous(), angle.sin().contiguous()


def _most_block_rows(activations: str) -> int:
    """The most rows of x whose products run on the blocks with ``activations`` (the ops called one by one, the
    reference, take the wide copy from one more); where they never leave the blocks (int16 against a bfloat16 copy),
    more than a prefill chunk's 512."""
    n = wide_rows(wide_dtype(), activations)
    return n - 1 if n < NEVER else 600


def _set_activations(layer: llama.LayerWeights, activations: str) -> None:
    if activations == "bf16x2" and not decoder_ops.amx_available():
        pytest.skip("bf16x2 needs AMX-BF16, which this CPU has not")
    for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
        lin.set_activations(activations)


@pytest.mark.parametrize("activations", decoder_ops.ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 5, None])
def test_attn_in_is_norm_qkv_and_rope_bit_for_bit(fmt, rows, activations):
    """attn_in = rms_norm, the QKV product (with its bias) and RoPE on the q and k heads, exactly as called one by one;
    the value heads are not rotated. rows None: the most that the products take on the blocks (linear.py's rule)."""
    rows = rows or _most_block_rows(activations)
    layer = _layer(fmt, qkv_bias=True)
    _set_activations(layer, activations)
    x = torch.randn(rows, D) * 2
    cos, sin = _rope(rows)
    fused = decoder_ops.attn_in(x, layer.attn_norm, 1e-5, layer.qkv.blocks, cos, sin, H + H_KV, D_HEAD, activations)
    ref = layer.qkv(decoder_ops.rms_norm(x, layer.attn_norm, 1e-5))
    unrotated = ref.clone()
    llama.rope_(ref.view(rows, -1, D_HEAD)[:, :H + H_KV], cos, sin)
    assert torch.equal(fused, ref)
    assert torch.equal(fused[:, (H + H_KV) * D_HEAD:], unrotated[:, (H + H_KV) * D_HEAD:])


@pytest.mark.parametrize("activations", decoder_ops.ACTIVATIONS)
@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 5, None])
def test_mlp_out_is_o_residual_norm_and_swiglu_mlp_bit_for_bit(fmt, rows, activations):
    """mlp_out = x1 + swiglu(rms_norm(x1) W_gu^T) W_down^T with x1 = x + a W_o^T, the same ops one by one (rows None:
    as in test_attn_in_is_norm_qkv_and_rope_bit_for_bit)."""
    rows = rows or _most_block_rows(activations)
    layer = _layer(fmt, qkv_bias=False)
    _set_activations(layer, activations)
    x, a = torch.randn(rows, D) * 2, torch.randn(rows, H * D_HEAD)
    fused = decoder_ops.mlp_out(x, a, layer.o.blocks, layer.mlp_norm, 1e-5, layer.gate_up.blocks, layer.down.blocks,
                                activations)
    x1 = layer.o(a, residual=x)
    ref = layer.down(decoder_ops.swiglu(layer.gate_up(decoder_ops.rms_norm(x1, layer.mlp_norm, 1e-5))), residual=x1)
    assert torch.equal(fused, ref)


def test_swiglu_equals_the_float64_product():
    """silu(g) * u in float32 within a few ulps of the float64 value, over a range that saturates the sigmoid."""
    torch.manual_seed(1)
    gu = torch.randn(7, 2 * 300) * 6
    g, u = gu.double().chunk(2, dim=-1)
    ref = (F.silu(g) * u).float()
    torch.testing.assert_close(decoder_ops.swiglu(gu), ref, rtol=4 * EPS32, atol=1e-30)


def test_fused_ops_refuse_what_they_cannot_read():
    layer = _layer("int4", qkv_bias=False)
    cos, sin = _rope(1)
    with pytest.raises(ValueError, match="rot_heads"):
        decoder_ops.attn_in(torch.randn(1, D), layer.attn_norm, 1e-5, layer.qkv.blocks, cos, sin, H + 2 * H_KV + 1,
                            D_HEAD)
    with pytest.raises(ValueError, match="gu must be"):
        decoder_ops.swiglu(torch.randn(2, 7))
    with pytest.raises(ValueError, match="x must be"):
        decoder_ops.mlp_out(torch.randn(1, D).double(), torch.randn(1, H * D_HEAD), layer.o.blocks, layer.mlp_norm,
                            1e-5, layer.gate_up.blocks, layer.down.blocks)


@pytest.mark.slow
def test_embedded_model_decodes_the_same_with_the_fused_layers():
    """The embedded model (its GGUF blocks as stored, float32 KV cache so no 16-bit rounding amplifies the
    last-bit differences of swiglu's exp, float32 activations for the same reason: bf16x2's limbs turn a last-bit
    difference of x into one of up to 2^-17, its lo limb rounding the other way; test_attn_in_... and
    test_mlp_out_... check bf16x2's fused halves bit for bit): greedy tokens and logits of 12 decode steps with
    the fused layer halves equal those of the ops called one by one."""
    from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig

    runner = ModelRunner(RuntimeConfig(kv_dtype="float32", activations="float32"))
    assert runner.decoder.fused
    prompt = runner.encode("In the beginning God created the heaven and the earth. And the earth was")
    runs = {}
    for fused in (True, False):
        runner.decoder.__dict__["fused"] = fused  # the cached property, set for this comparison
        session = runner.open_session(MethodSpec.of("full"))
        logits = runner.prefill(session, prompt)
        tokens, steps = [], []
        for _ in range(12):
            tokens.append(int(logits.argmax()))
            logits, _ = runner.decode([session], [tokens[-1]])
            logits = logits[0]
            steps.append(logits)
        runner.close_session(session)
        runs[fused] = tokens, torch.stack(steps)
    assert runs[True][0] == runs[False][0]
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)
