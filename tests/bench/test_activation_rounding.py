"""bench.eval.activation_rounding's roundings against their definitions: int8 equals the runtime's own int8
activations (the library's quantize_activations), the limb roundings keep the bits their docstring states, and
the hooks round exactly the Linear inputs and come off cleanly."""

from __future__ import annotations

import pytest
import torch

from bench.eval import activation_rounding as ar


def activations(rows: int = 8, width: int = 576, seed: int = 0) -> torch.Tensor:
    """Normal values with a few large outliers per row, as LLM hidden states have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g)
    x[:, torch.randint(0, width, (4,), generator=g)] *= 60
    return x


def test_int8_equals_the_runtime_int8_activations():
    from retopk_core.cpu import decoder_ops

    if not decoder_ops.available():
        pytest.skip("the CPU library is not built")
    x = activations()
    qx, xs = decoder_ops.quantize_activations(x)
    runtime = (qx.float().reshape(8, -1, 32) * xs[..., :1]).reshape(x.shape)
    assert torch.equal(ar.int8(x), runtime)


def test_two_bf16_limbs_keep_16_significant_bits_and_one_does_not():
    x = activations()
    err2 = (ar.WAYS["bf16x2"](x) - x).abs()
    err1 = (ar.WAYS["bf16"](x) - x).abs()
    assert bool((err2 <= 2.0 ** -17 * x.abs()).all())
    assert float((err1 / x.abs()).max()) > 2.0 ** -10  # one limb: about 8 bits


def test_two_int8_limbs_are_within_dx_over_256_of_x():
    # |y - hi| <= 1/2, so 256 (y - hi) rounds within 1/2 or, clamped at +-127 from +-128, within 1
    x = activations()
    dx = x.reshape(8, -1, 32).abs().amax(-1, keepdim=True) / 127
    err = (ar.int8x2(x) - x).reshape(8, -1, 32).abs()
    assert bool((err <= dx / 256 * (1 + 1e-5)).all())
    assert float(err.max()) < float((ar.int8(x) - x).abs().max()) / 100


def test_all_zero_blocks_stay_zero():
    x = torch.zeros(2, 64)
    for name in ("int8", "int8x2"):
        assert torch.equal(ar.WAYS[name](x), x)


def test_hooks_round_each_linear_input_and_come_off():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    x = activations(rows=3, width=64)
    plain = model(x)
    way = ar.WAYS["int8"]
    hooks = ar.rounded_inputs(model, way)
    rounded = model(x)
    for h in hooks:
        h.remove()
    expected = model[2](way(model[1](model[0](way(x)))))
    assert torch.equal(rounded, expected)
    assert not torch.equal(rounded, plain)
    assert torch.equal(model(x), plain)
