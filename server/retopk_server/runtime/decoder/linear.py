"""Weight formats of the decoder's linear layers: y = x W^T (+ b), x (M, in) float32 -> y (M, out) float32.

- ``DenseLinear``: W in float32, bfloat16 or float16; x is cast to W's dtype for the matmul.
- ``Int4Linear``: 4-bit group-wise asymmetric weights, groups of ``group`` along the input dimension:
  W[o, i] = (q[o, i] - 8) * s[o, g] + z[o, g], g = i // group, q in 0..15. torch's packed CPU op
  (``_weight_int4pack_mm_for_cpu``) reads the nibbles and the bfloat16 (s, z) pairs; x runs in bfloat16.
  GGUF's Q4_1 block (d, m, q) is w = d * q + m, i.e. s = d, z = m + 8 d; Q4_0's (d, q) is w = d (q - 8),
  i.e. s = d, z = 0. Both map exactly (up to rounding d and m to bfloat16).
- ``Int8Linear``: W[o, i] = q[o, i] * s[o], q int8, one scale per output row (``_weight_int8pack_mm``).

Every format keeps the float32 residual stream outside: only the matmul runs in 16 bits, its result is
widened again. ``nbytes`` is what one matmul reads, the decode step's weight traffic.

The packed ops are GEMVs: at prefill's row counts they run an order of magnitude slower than a GEMM
(BENCHMARKS.md). The quantized formats therefore also hold their weights dequantized in ``wide_dtype()``
(bfloat16 where the CPU has bf16 dot products, else float32) and multiply through it from ``WIDE_ROWS``
rows on: decode steps read the packed bytes, prefill chunks run a GEMM.
"""

from __future__ import annotations

import torch

INT4_GROUP = 32
WIDE_ROWS = 16  # rows of x from which a quantized linear multiplies through its dequantized copy


def wide_dtype() -> torch.dtype:
    """The dtype of the quantized formats' dequantized copies: bfloat16 where the CPU multiplies it natively."""
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


def float_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, in) float32 @ weight (out, in)^T in the weight's float dtype -> (M, out) float32 (+ bias): a dense
    layer's product, and a quantized one's prefill GEMM through its dequantized copy."""
    y = torch.nn.functional.linear(x.to(weight.dtype), weight).float()
    return y if bias is None else y + bias


def quantized_matmul(lin, x: torch.Tensor, packed_mm) -> torch.Tensor:
    """A quantized linear's product: from WIDE_ROWS rows of x on through its dequantized copy ``lin.wide``,
    else ``packed_mm`` (its packed op) on x in bfloat16; (M, out) float32 (+ bias)."""
    if x.shape[0] >= WIDE_ROWS:
        return float_matmul(x, lin.wide, lin.bias)
    y = packed_mm(x.to(torch.bfloat16)).float()
    return y if lin.bias is None else y + lin.bias


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.contiguous()  # (out, in)
        self.bias = None if bias is None else bias.float()  # (out,)
        self.format = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[weight.dtype]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return float_matmul(x, self.weight, self.bias)  # (M, out)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def to(self, device: torch.device) -> DenseLinear:
        return DenseLinear(self.weight.to(device), None if self.bias is None else self.bias.to(device))


class Int4Linear:
    format = "int4"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = INT4_GROUP) -> None:
        """q (out, in) integers in 0..15; scale, zero (out, in // group) float."""
        out, inp = q.shape
        if not int4_fits(out, inp, group):
            raise ValueError(f"int4 needs out % 16 == 0 and in % {group} == 0, got ({out}, {inp})")
        self.group, self.out_features = group, out
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # (in/g, out, 2)
        self.bias = None if bias is None else bias.float()
        s, z = (self.scale_zero[..., i].t().float().unsqueeze(-1) for i in (0, 1))  # (out, in/g, 1), as the op reads
        self.wide = ((q.float().view(out, -1, group) - 8) * s + z).view(out, inp).to(wide_dtype())  # (out, in)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, group: int = INT4_GROUP) -> Int4Linear:
        """Round-to-nearest asymmetric quantization of a float weight (out, in): per group, s = (max - min) / 15
        and z = min + 8 s, both rounded to the bfloat16 the op stores, then q = round((w - z) / s) + 8."""
        w = weight.float().unflatten(1, (-1, group))  # (out, in/g, g)
        lo, hi = w.amin(-1), w.amax(-1)  # (out, in/g)
        s = ((hi - lo) / 15).clamp_min(1e-12).bfloat16().float()
        z = (lo + 8 * s).bfloat16().float()
        q = ((w - z.unsqueeze(-1)) / s.unsqueeze(-1) + 8).round().clamp(0, 15).flatten(1)
        return cls(q, s, z, bias, group)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scale_zero.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(self, x, lambda xb: torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, self.packed, self.group, self.scale_zero))  # (M, out)

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32, by multiplying the identity: the op's own reading of its packed weights."""
        inp = self.scale_zero.shape[0] * self.group
        eye = torch.eye(inp, dtype=torch.bfloat16)
        w = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero)
        return w.float().t().contiguous()

    def to(self, device: torch.device) -> Int4Linear:
        return _cpu_only(self, device)


class Int8Linear:
    format = "int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """q (out, in) int8, scale (out,) float."""
        self.q = q.to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.float()
        self.wide = (self.q.float() * self.scale.float().unsqueeze(1)).to(wide_dtype())  # (out, in)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric per-row quantization: s = max |w| / 127 rounded to the bfloat16 the op stores, q = round(w / s)."""
        w = weight.float()
        s = (w.abs().amax(1) / 127).clamp_min(1e-12).bfloat16().float()  # (out,)
        return cls((w / s.unsqueeze(1)).round().clamp(-127, 127), s, bias)

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_matmul(self, x, lambda xb: torch.ops.aten._weight_int8pack_mm(xb, self.q, self.scale))

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale.float().unsqueeze(1)

    def to(self, device: torch.device) -> Int8Linear:
        return _cpu_only(self, device)


def _cpu_only(lin, device: torch.device):
    if torch.device(device).type != "cpu":
        raise ValueError(f"{lin.format} weights run on the CPU only (torch's packed CPU ops); on {device} use "
                         "weights=bfloat16 or float16")
    return lin


Linear = DenseLinear | Int4Linear | Int8Linear


def int4_fits(out: int, inp: int, group: int = INT4_GROUP) -> bool:
    return out % 16 == 0 and inp % group == 0


def from_float(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> Linear:
    """A float weight (out, in) in ``fmt`` (float32, bfloat16, float16, int8, int4). int4 falls back to int8
    for shapes the packed op cannot take."""
    if fmt == "int4" and int4_fits(*weight.shape):
        return Int4Linear.quantize(weight, bias)
    if fmt in ("int4", "int8"):
        return Int8Linear.quantize(weight, bias)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[fmt]
    return DenseLinear(weight.detach().to(dtype), None if bias is None else bias.detach())
