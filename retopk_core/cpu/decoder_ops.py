"""The launcher of the decoder's CPU ops (decoder_ops.cpp, compiled into the fused kernel's library).

    block_matmul(x, qs, scales, bits, bias, residual) -> x W^T (+ bias) (+ residual), W in GGUF blocks of 32
    quantize_activations(x) -> (qx, xs): x per row and block of 32 as int8 values and (dx, sx) per block
    pack_units(qs, scales) -> a Q4_1 or Q8_0 weight's units of 16 outputs for bf16x2 and int16 products (in place of qs)
    rms_norm(x, w, eps) -> x / sqrt(mean(x^2) + eps) * w
    rope_(x, cos, sin): x <- x cos + rotate_half(x) sin, in place
    store_kv(k_pool, v_pool, rows, k, v): pools[rows] <- k, v in the pools' dtype (float16 saturated at ±65504)
    swiglu(gu) -> silu(g) * u for gu = [g, u]
    packed_linear_rows(x, w) -> x W^T for W in oneDNN's packed layout: one oneDNN call per thread on its share of rows
    causal_attention_segments_(out, q, k, v, offsets, lengths, scale): out <- each segment's causal SDPA, a thread each
    attn_in(x, w_attn, eps, qkv, cos, sin, rot_heads, d) -> rope(rms_norm(x) W_qkv^T (+ b)) on its first rot_heads heads
    mlp_out(x, a, o, w_mlp, eps, gate_up, down) -> x1 + swiglu(rms_norm(x1) W_gu^T) W_down^T, x1 = x + a W_o^T
    LayerPlan(layer weights, ..., attention)(x, ...) -> every layer of a decode step in one call (its per-model
      arguments converted once): attn_in, the step's keys and values stored, the attention (cpu/launch.py's
      LayerAttention), mlp_out, layer by layer

``attn_in`` and ``mlp_out`` are a decode layer's two halves around its attention, each the ops above in the
order the unfused path calls them (so each result equals that path's); their weights are ``Blocks``.

They compute in float32; the source's header states the block layouts and the math, and each entry checks
shapes and dtypes (ValueError naming the argument). The block products take ``activations`` (ACTIVATIONS):
"float32" (x as it is, the default), "int8" (x quantized per row and block of 32, llama.cpp's Q8_0 / Q8_1
activations, and integer block dots), "bf16x2" (x as two bf16 limbs on AMX tiles; where ``amx_available()``)
or "int16" (x quantized per row and block of 32 to int16 with one scale, then exact integer block dots: the same
bits at every SIMD level, AVX-512 VNNI's dpwssd the fast one); with bf16x2 and int16 (UNIT_ACTIVATIONS) every
product's qs is ``pack_units``'s units. ``available()`` says whether the library loads;
callers fall back to torch when it does not.

The SIMD level the block products run at is the library's (``isa()``: cpu/launch.py sets it at load, the CPU's
best unless ``RETOPK_CPU_ISA`` asks for a lower one; ``best_isa()`` the CPU's); the tests pass ``level`` to cover
every level this CPU has.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from retopk_core.cpu.launch import ISA_NAMES, PATH_CODES, LayerAttention, available, extension

# what the block products multiply the weights with (the source's codes 0, 1, 2, 3)
ACTIVATIONS = ("float32", "int8", "bf16x2", "int16")
UNIT_ACTIVATIONS = ("bf16x2", "int16")  # those whose products take pack_units's units in place of qs

__all__ = ["ACTIVATIONS", "ISA_NAMES", "UNIT_ACTIVATIONS", "Blocks", "LayerPlan", "activation_code", "amx_available",
           "attn_in", "available", "best_isa", "block_matmul", "causal_attention_segments_", "isa", "layer_arguments",
           "mlp_out", "pack_units", "packed_linear_rows", "quantize_activations", "rms_norm", "rope_", "store_kv",
           "swiglu"]


class Blocks(NamedTuple):
    """A block-quantized weight as ``block_matmul`` takes it: qs (for UNIT_ACTIVATIONS, ``pack_units``'s units), scales
    for ``bits`` 4 or 8, and a float32 bias."""

    qs: torch.Tensor
    scales: torch.Tensor
    bits: int
    bias: torch.Tensor | None


def best_isa() -> int:
    """The CPU's widest SIMD level (ISA_NAMES' code)."""
    return int(extension().best_isa())


def isa() -> int:
    """The SIMD level the ops use: the library's, set once at load (cpu/launch.py: the CPU's best, or
    RETOPK_CPU_ISA's if that is lower)."""
    return int(extension().isa_level())


def amx_available() -> bool:
    """Whether bf16x2 products can run: the library loads, the CPU has AMX-BF16 and Linux granted the tiles, and
    RETOPK_CPU_ISA does not ask for a level below AVX-512 (so that it shows this machine as an AVX2 one would)."""
    return available() and isa() >= ISA_NAMES.index("avx512") and bool(extension().amx_available())


def pack_units(qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A block weight -> its units of 16 outputs, which bf16x2 and int16 products take (decoder_ops.cpp's header
    states their order: AMX's B tiles, and AVX-512 VNNI's dpwssd pairs as they are); out a multiple of 16. Q4_1:
    qs (out, in / 2) uint8, scales (out, in / 32, 2) float16 -> (out, in / 32 * 20) uint8; Q8_0: qs
    (out, in) int8, scales (out, in / 32) float16 -> (out, in / 32 * 34) int8."""
    return extension().pack_units(qs.contiguous(), scales.contiguous())


def activation_code(activations: str) -> int:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    return ACTIVATIONS.index(activations)


def block_matmul(x: torch.Tensor, qs: torch.Tensor, scales: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, level: int | None = None,
                 activations: str = "float32") -> torch.Tensor:
    """x (M, in) float32 -> (M, out) float32; qs / scales as decoder_ops.cpp describes for ``bits`` 4 or 8."""
    return extension().block_matmul(x.contiguous(), qs, scales, bits, bias, residual, isa() if level is None else level,
                                    activation_code(activations))


def quantize_activations(x: torch.Tensor, level: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, in) float32 -> qx (M, in) int8, xs (M, in / 32, 2) float32 = (dx, sx) per block: the int8 path's x."""
    qx, xs = extension().quantize_activations(x.contiguous(), isa() if level is None else level)
    return qx, xs


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x (M, D) float32 -> (M, D) float32."""
    return extension().rms_norm(x.contiguous(), w, float(eps))


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x (N, heads, d) float32, unit stride along d; cos, sin (N, d) float32."""
    extension().rope_(x, cos, sin)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Pools (..., d) contiguous, viewed as rows; rows (B, H_kv, T) int64; k, v (B, H_kv, T, d) float32."""
    extension().store_kv(k_pool, v_pool, rows, k, v)


def swiglu(gu: torch.Tensor) -> torch.Tensor:
    """gu (M, 2F) float32 -> (M, F)."""
    return extension().swiglu(gu.contiguous())


def packed_linear_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, in) in w's dtype, w (out, in) packed by ``torch.ops.mkldnn._reorder_linear_weight`` -> (M, out) in that
    dtype: rows M p / P .. M (p + 1) / P - 1 of the result are ``torch.ops.mkldnn._linear_pointwise`` of those rows
    of x, each part computed on its own thread of torch's P threads."""
    return extension().packed_linear_rows(x.contiguous(), w)


def causal_attention_segments_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               offsets: list[int], lengths: list[int], scale: float) -> None:
    """q (1, H, N, d), k, v (1, H_kv, N, d); out (1, N, H, d) <- at rows a .. a + T - 1 for each (a, T) of
    ``offsets``, ``lengths``: ``F.scaled_dot_product_attention(q[:, :, a:a+T], k[:, :, a:a+T], v[:, :, a:a+T],
    is_causal=True, scale=scale, enable_gqa=True)`` transposed, each segment computed on one thread of the team."""
    extension().causal_attention_segments_(out, q, k, v, offsets, lengths, scale)


def attn_in(x: torch.Tensor, w_attn: torch.Tensor, eps: float, qkv: Blocks, cos: torch.Tensor, sin: torch.Tensor,
            rot_heads: int, d: int, activations: str = "float32") -> torch.Tensor:
    """x (M, D) float32 -> qkv (M, out) float32, heads 0..rot_heads-1 (of d values each) rotated; cos, sin (M, d)."""
    return extension().attn_in(x, w_attn, float(eps), qkv.qs, qkv.scales, qkv.bits, qkv.bias, cos, sin, rot_heads, d,
                               isa(), activation_code(activations))


def mlp_out(x: torch.Tensor, a: torch.Tensor, o: Blocks, w_mlp: torch.Tensor, eps: float, gate_up: Blocks,
            down: Blocks, activations: str = "float32") -> torch.Tensor:
    """x (M, D), a (M, H d) float32 -> the residual stream after the layer's o product and MLP, (M, D)."""
    return extension().mlp_out(x, a.contiguous(), o.qs, o.scales, o.bits, o.bias, w_mlp, float(eps), gate_up.qs,
                               gate_up.scales, gate_up.bits, gate_up.bias, down.qs, down.scales, down.bits, down.bias,
                               isa(), activation_code(activations))


_NO_BIAS = torch.empty(0)


def layer_arguments(layers: list[tuple]) -> tuple[list[torch.Tensor], list[int]]:
    """Per layer (attn_norm, qkv, o, mlp_norm, gate_up, down), the products as Blocks -> ``LayerPlan``'s
    weights (14 tensors a layer, an empty tensor for a missing bias) and bits (4 a layer)."""
    weights, bits = [], []
    for attn_norm, qkv, o, mlp_norm, gate_up, down in layers:
        for item in (attn_norm, qkv, o, mlp_norm, gate_up, down):
            if isinstance(item, Blocks):
                weights += [item.qs, item.scales, _NO_BIAS if item.bias is None else item.bias]
                bits.append(item.bits)
            else:
                weights.append(item)
    return weights, bits


class LayerPlan:
    """The one-call step's arguments that stay the same from step to step, converted once (decode_layers.cpp's
    DecodeLayers): the weights and bits of ``layer_arguments``, eps, shape = (H, H_kv, d), each layer's pools,
    the attention (cpu/launch.py's LayerAttention) and the activations. The pools and the attention's state are
    held weakly: prepare a new plan whenever they are reallocated (a step on a reallocated one raises
    ValueError). ``path``: the attention's path code for a dense kind."""

    def __init__(self, weights: list[torch.Tensor], bits: list[int], eps: float, shape: tuple[int, int, int],
                 k_pools: list[torch.Tensor], v_pools: list[torch.Tensor], attention: LayerAttention,
                 activations: str = "float32") -> None:
        H, H_kv, d = shape
        a = attention
        self.path = a.path  # not the attention itself: it holds the state strongly
        self._layers = extension().DecodeLayers(weights, bits, float(eps), H, H_kv, d, k_pools, v_pools, a.kind,
                                                a.state, a.ints, a.retrieval, a.gqa_policy, a.floats, PATH_CODES,
                                                a.calibration, a.guard, isa(), activation_code(activations))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, slots: torch.Tensor | None,
                 with_stats: bool = True) -> tuple[torch.Tensor, float, list[tuple]]:
        """One step: x (B, D) float32 -> (x (B, D), seconds spent in the attention, per layer (path, max_sim,
        n_scored) for ReTopK with ``with_stats``, else []). rows (B, H_kv, 1) the pool rows of the step's token;
        table, lengths the rows' block table and lengths; slots (layers, B) the rows' state slots (None for a
        method without state)."""
        res = self._layers.run(x, cos, sin, rows, table, lengths, _NO_BIAS if slots is None else slots, with_stats)
        return res[0], float(res[1]), [tuple(res[i:i + 3]) for i in range(2, len(res), 3)]

