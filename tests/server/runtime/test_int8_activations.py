"""Block products with int8-quantized activations (decoder_ops.cpp's ``activations`` int8): the quantizer against
its rounding rule written in torch, and the products against the same formula in float64 (x quantized the same
way, dequantized, multiplied by the float64 weights), the SIMD loops (AVX2, and AVX-512 VNNI where the CPU has it)
against the plain C++ one and against each other bit for bit, for Q4_1, Q4_0 and Q8_0 weights with extreme blocks,
on shapes whose input is not a multiple of 64, one to eight rows and a batch; then the runtime option that selects
them (RuntimeConfig.activations) and what it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import first_step, prompt_ids, runner_for, tiny_model

from retopk_core.cpu import decoder_ops
from retopk_server.runtime import RuntimeConfig
from retopk_server.runtime.decoder.linear import Int4Linear, Int8Linear, from_float, wide_dtype, wide_rows

pytestmark = pytest.mark.skipif(not decoder_ops.available(), reason="the fused CPU library is not built")

EPS32 = torch.finfo(torch.float32).eps
MIN_AMAX = 127 * torch.finfo(torch.float32).tiny  # below it a block quantizes to zeros (decoder_ops.cpp)


ROOT = Path(__file__).resolve().parents[3]


def _levels() -> list[int]:
    return list(range(decoder_ops.best_isa() + 1))


def block_linear(fmt: str, n_out: int, n_in: int, bias: torch.Tensor | None = None) -> Int4Linear | Int8Linear:
    """Random GGUF-style blocks (out, in) in ``fmt``: q4_1 and q8_0 quantized from a float weight, q4_0 as random
    nibbles with m = -8 d (GGUF's Q4_0, w = d (q - 8)). Row 0 holds the extremes: block 0 at the largest code
    (nibbles 15, or 127), block 1 at the smallest (nibbles 0, or -128, which GGUF's quantizer never writes but a
    file may hold); row 1's block 1 at the largest code too."""
    if fmt == "q4_0":
        d = (torch.rand(n_out, n_in // 32) * 0.02 + 1e-3).half().float()
        lin = Int4Linear.from_values(torch.randint(0, 16, (n_out, n_in)), d, -8 * d, bias)
    else:
        lin = from_float(torch.randn(n_out, n_in) * 0.1, bias, {"q4_1": "int4", "q8_0": "int8"}[fmt])
    step = 16 if lin.bits == 4 else 32  # bytes per block
    lin.qs[0, :step] = 0xFF if lin.bits == 4 else 127
    lin.qs[0, step:2 * step] = 0 if lin.bits == 4 else -128
    lin.qs[1, step:2 * step] = 0xFF if lin.bits == 4 else 127
    return lin


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in float32 torch ops: per row and block of 32, dx = max |x| / 127, qx = round_half_even(x * (1 / dx)),
    sx = dx * sum qx -> qx (M, in) int8, xs (M, in / 32, 2) float32."""
    b = x.unflatten(1, (-1, 32))  # (M, nb, 32)
    amax = b.abs().amax(-1)  # (M, nb)
    dx = torch.where(amax >= MIN_AMAX, amax / 127, torch.zeros_like(amax))
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(b * inv.unsqueeze(-1))  # (M, nb, 32), torch.round: half to even
    sx = dx * q.sum(-1)
    return q.flatten(1).to(torch.int8), torch.stack([dx, sx], dim=-1)


def weights64(lin) -> tuple[torch.Tensor, torch.Tensor]:
    """The block weights in float64: d q + m (Q4_1) or d q (Q8_0), (out, in), without float32 rounding; and the
    magnitude of the terms the kernel sums, |d q| + |m| per weight."""
    if isinstance(lin, Int4Linear):
        blocks = lin.qs.view(lin.qs.shape[0], -1, 16)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).double()  # (out, nb, 32)
        d, m = lin.scales.double()[..., :1], lin.scales.double()[..., 1:]  # (out, nb, 1) each
        return (q * d + m).flatten(1), (q * d.abs() + m.abs()).flatten(1)
    w = (lin.qs.view(lin.qs.shape[0], -1, 32).double() * lin.scales.double().unsqueeze(-1)).flatten(1)
    return w, w.abs()


def test_quantizer_rounds_half_to_even_per_block_at_every_level():
    """Both levels' bytes and scales equal the torch rule's exactly: random rows over several magnitudes, a block
    of zeros, a block too small to scale, and ties (max 127: dx = 1, so x.5 rounds to even)."""
    torch.manual_seed(0)
    x = torch.randn(5, 160) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.5]).unsqueeze(1)
    x[1, 32:64] = 0
    x[2, 64:96] = 1e-39
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 4)
    x[3, 96:128] = ties
    want_q, want_s = quantize(x)
    assert want_q[3, 96:104].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert (want_q[1, 32:64] == 0).all() and (want_q[2, 64:96] == 0).all() and want_s[2, 2].tolist() == [0, 0]
    for level in _levels():
        qx, xs = decoder_ops.quantize_activations(x, level)
        assert torch.equal(qx, want_q), f"isa level {level}"
        assert torch.equal(xs, want_s), f"isa level {level}"
    assert (want_q.abs() <= 127).all()
    err = (want_q.double().unflatten(1, (-1, 32)) * want_s[..., :1].double() - x.double().unflatten(1, (-1, 32))).abs()
    # within half a step of the block's grid (a block below MIN_AMAX is all zeros: its values are the error)
    assert (err <= want_s[..., :1].double() * (0.5 + 2 * EPS32) + MIN_AMAX).all()


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
@pytest.mark.parametrize("shape", [(1, 96, 40), (2, 160, 72), (3, 576, 64), (4, 224, 33), (5, 96, 80), (8, 288, 48),
                                   (3, 32 * 131, 17), (wide_rows(wide_dtype(), "int8") - 1, 352, 24)])
def test_int8_block_matmul_equals_the_float64_formula(fmt, shape):
    """y = quantized(x) W^T + b + residual through the block kernel at every SIMD level equals the float64 product
    of x quantized by the rule and dequantized with the float64 weights, within float32 rounding of its sum over
    blocks (each block's integer dot is exact); the SIMD and plain loops agree as tightly, and the SIMD loops
    (AVX2's, which AVX-512 without VNNI runs, and VNNI's) equal each other bit for bit: the same integer lanes
    and float operations in the same order. x's row 0 has a block of zeros (dx = 0) then a block at qx = +-127
    against row 0's extreme weight blocks (block_linear); 131 blocks span three chunks of widened scales."""
    rows, n_in, n_out = shape
    torch.manual_seed(n_in + rows)
    lin = block_linear(fmt, n_out, n_in, torch.randn(n_out))
    x, res = torch.randn(rows, n_in) * 3, torch.randn(rows, n_out)
    x[0, :32] = 0
    x[0, 32:64] = torch.tensor([5.0, -5.0]).repeat(16)  # qx = 127, -127, ...
    x[-1, 32:64] = -2.0  # qx = -127 throughout: against nibbles 0 / -128 in row 0's block 1
    qx, xs = quantize(x)
    xq = (qx.double().unflatten(1, (-1, 32)) * xs[..., :1].double()).flatten(1)  # (M, in): the dequantized activations
    w, w_abs = weights64(lin)
    ref = xq @ w.T + lin.bias.double() + res.double()
    scale = xq.abs() @ w_abs.T + lin.bias.abs().double() + res.abs().double()  # bounds the summed terms' magnitude
    # a few float32 roundings of the sum's magnitude (as for float32 activations), well below one activation
    # rounded to the neighbouring step (dx |w|), which this therefore catches
    tol = 4 * EPS32 * scale
    ys = []
    for level in _levels():
        y = decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, res, level, activations="int8")
        assert y.dtype == torch.float32 and y.shape == (rows, n_out)
        assert ((y.double() - ref).abs() <= tol).all(), f"isa level {level}"
        ys.append(y.double())
    for y in ys[1:]:
        assert ((y - ys[0]).abs() <= tol).all()
    for level, y in enumerate(ys[2:], start=2):
        assert torch.equal(y, ys[1]), f"isa level {level} against AVX2's"
    # and the quantization error itself is bounded: at most half a step of each block's grid per input
    f32 = decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, res)
    step = (xs[..., :1].double() / 2).expand(-1, -1, 32).flatten(1)  # (M, in)
    assert ((ys[-1] - f32.double()).abs() <= step @ w.abs().T + 2 * tol).all()


@pytest.mark.parametrize("fmt", ["q4_1", "q4_0", "q8_0"])
def test_int8_rows_do_not_depend_on_their_batch(fmt):
    """Each row of a batch through the int8 path is bit for bit the row alone, at every level (the batch shares
    each weight block's unpacking, not the sums)."""
    torch.manual_seed(3)
    lin = block_linear(fmt, 40, 160)
    x = torch.randn(11, 160)
    for level in _levels():
        batch = decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, None, None, level, activations="int8")
        for i in range(x.shape[0]):
            alone = decoder_ops.block_matmul(x[i:i + 1], lin.qs, lin.scales, lin.bits, None, None, level,
                                             activations="int8")
            assert torch.equal(batch[i:i + 1], alone), f"row {i}, isa level {level}"


def test_simd_level_follows_the_cpu_flags():
    """best_isa() against the CPU's flags as Linux reports them: 3 (AVX-512 VNNI, the int8 products' dpbusd
    loop) only with avx512_vnni beside AVX-512 F/BW/VL/DQ, so an AVX-512 CPU without VNNI keeps level 2 (the AVX2
    int8 loop); 1 with AVX2, FMA and F16C."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if not flags or "sse2" not in flags:
        pytest.skip("needs an x86 Linux /proc/cpuinfo")
    want = 0
    if {"avx2", "fma", "f16c"} <= flags:
        want = 1
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            want = 3 if "avx512_vnni" in flags else 2
    assert decoder_ops.best_isa() == want


def _in_fresh_process(isa: str | None, code: str) -> subprocess.CompletedProcess:
    """``code`` run by a new interpreter in the repository root, RETOPK_CPU_ISA set to ``isa`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != "RETOPK_CPU_ISA"}
    if isa is not None:
        env["RETOPK_CPU_ISA"] = isa
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)


LEVELS = ("from retopk_core.cpu import decoder_ops, launch; lib = launch.extension(); "
          "print(lib.isa_level(), decoder_ops.isa(), int(lib.wide_key_scoring()))")


@pytest.mark.parametrize("isa, name", [(None, "avx512_vnni"), ("", "avx512_vnni"), ("avx2", "avx2"),
                                       ("AVX2", "avx2"), (" avx2\n", "avx2"), ("Avx512 ", "avx512"),
                                       ("SCALAR", "scalar"), ("avx512_VNNI", "avx512_vnni")])
def test_retopk_cpu_isa_sets_one_level_for_the_ops_and_the_key_scoring(isa, name):
    """RETOPK_CPU_ISA in any case, blanks around it ignored, read once at load: the library holds min(best_isa(),
    its level), decoder_ops.isa() reports that level, and the fused attention's key scoring (retopk_cpu.cpp's
    dot_heads) takes its AVX-512 loops exactly when the level is AVX-512 or above (so ``avx2`` or ``scalar`` on
    this AVX-512 CPU times its AVX2 loop). Unset or blank: the CPU's best."""
    level = min(decoder_ops.best_isa(), decoder_ops.ISA_NAMES.index(name))
    done = _in_fresh_process(isa, LEVELS)
    assert done.returncode == 0, done.stderr
    assert [int(v) for v in done.stdout.split()] == [level, level, int(level >= decoder_ops.ISA_NAMES.index("avx512"))]


@pytest.mark.parametrize("built", [True, False])
def test_a_bad_retopk_cpu_isa_is_an_error_naming_it(built):
    """A value outside ISA_NAMES: ValueError naming the variable and the allowed names from the first use of the
    library (what the server's startup asks first), with the library built or missing."""
    missing = "" if built else "build.LIBRARY = build.LIBRARY.with_name('missing.so'); "
    done = _in_fresh_process("avx3", f"from retopk_core.cpu import build, launch; {missing}launch.available()")
    assert done.returncode != 0
    assert ("ValueError: RETOPK_CPU_ISA must be one of scalar, avx2, avx512, avx512_vnni, got 'avx3'"
            in done.stderr), done.stderr


def test_int8_block_matmul_refuses_unknown_activations():
    lin = from_float(torch.randn(8, 64), None, "int4")
    with pytest.raises(ValueError, match="activations must be one of"):
        decoder_ops.block_matmul(torch.randn(1, 64), lin.qs, lin.scales, 4, activations="int4")
    with pytest.raises(ValueError, match="activations must be 0"):
        decoder_ops.extension().block_matmul(torch.randn(1, 64), lin.qs, lin.scales, 4, None, None, 0, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        decoder_ops.quantize_activations(torch.randn(1, 48))


def test_runtime_option_reaches_every_block_product_and_is_shown():
    """activations=int8 on int4 weights: the weight format says so (what info and metrics report), every block
    linear multiplies with int8 activations, and the logits differ from float32 activations' (the LM head's and
    the decode step's products) by a little; the prefill's layers (through the wide copy) are unchanged: the
    same KV rows."""
    model = tiny_model("llama", layers=2)
    runners = {a: runner_for(model, weights="int4", activations=a) for a in ("float32", "int8")}
    assert runners["float32"].info.weight_format.startswith("int4, lm_head")
    assert runners["int8"].info.weight_format == runners["float32"].info.weight_format + ", activations int8"
    blocks = [lin for lin in runners["int8"].decoder.linears() if hasattr(lin, "activations")]
    assert blocks and all(lin.activations == "int8" for lin in blocks)
    prompt = prompt_ids(20, 1)
    out = {a: first_step(runner, prompt) for a, runner in runners.items()}
    assert all(torch.equal(a, b) for a, b in zip(out["float32"][0], out["int8"][0], strict=True))
    for i in (1, 2):
        diff = (out["float32"][i] - out["int8"][i]).abs().max()
        assert 0 < diff < 0.05 * out["float32"][i].abs().max()


def test_runtime_option_refuses_what_it_cannot_apply():
    with pytest.raises(ValueError, match="activations must be one of"):
        RuntimeConfig(activations="int4")
    with pytest.raises(ValueError, match="needs device cpu"):
        RuntimeConfig(device="cuda", activations="int8")
    with pytest.raises(ValueError, match="needs block weights"):
        runner_for(tiny_model("llama", layers=1), weights="float32", activations="int8")
