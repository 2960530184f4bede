"""Weight formats of the decoder's linear layers: y = x W^T (+ b) (+ residual), x (M, in) float32 -> y (M, out)
float32.

- ``DenseLinear``: W in float32, bfloat16 or float16; x is cast to W's dtype for the matmul.
- ``Int4Linear``: GGUF's Q4_1 blocks, 32 weights along the input each: W[o, 32 b + j] = d q + m with q in
  0..15 and (d, m) float16 per block (Q4_0, w = d (q - 8), is m = -8 d, exactly). The nibbles stay packed
  as the file has them (block byte j: element j low, element j + 16 high).
- ``Int8Linear``: GGUF's Q8_0 blocks: W[o, 32 b + j] = d q, q int8, d float16 per block.

The quantized formats multiply in the fused CPU library's ``block_matmul`` (retopk_core/cpu/decoder_ops):
each weight widened exactly to float32, x float32, so a step equals the dequantized model's up to the
order of the sums; or, with ``activations`` "int8", x quantized per block of 32 and integer block dots; or, with
"bf16x2" (CPUs with AMX), x as two bf16 limbs on AMX tiles; or, with "int16", x quantized per block of 32 to int16
and exact integer block dots (AVX-512 VNNI's dpwssd); bf16x2 and int16 take the weight repacked into units of 16
outputs (``decoder_ops.pack_units``, held beside qs and scales while one of them is set).
Its cost grows with the rows of x (it widens each block again for every 4 rows); from ``wide_rows(dtype,
activations)`` rows on (prefill chunks, large decode batches) a GEMM through a dequantized copy (``wide``: bfloat16
where the CPU has bf16 dot products, else float32; ``set_wide_dtype`` changes it) is faster, and it is also the path
when the library is not built. The copy is made on first use (``hold_wide`` makes it ahead, at load), so a pair whose
rule is ``NEVER`` holds none: int16 activations against a 16-bit copy multiply every row count on the blocks (exact
integer products in place of the copy's bfloat16 weights: ``WIDE_ROWS`` says why), and so does
``set_wide_dtype(None)`` ("the blocks", for any activations). A bfloat16 copy is held reordered into oneDNN's blocked
layout (``packed``), so that its GEMMs skip repacking the weight on every call: the same products up to the order
oneDNN sums in (``packed``).
Norms, biases and the residual stream stay float32 in every format. ``nbytes`` is what one matmul reads,
the decode step's weight traffic.
"""

from __future__ import annotations

import math

import torch

from retopk_core.cpu import decoder_ops

BLOCK = 32  # weights per quantized block along the input
# A wide_rows value that no row count reaches: every product on the blocks, and no copy made.
NEVER = math.inf
# Rows of x from which a quantized linear multiplies through its dequantized copy, per (the copy's dtype, the block
# products' activations): the first M at which that GEMM is no slower than the block kernels over the served
# model's layers, set by bench/wide_rows.py (figures in docs/bench/history.md). With float32 activations: the
# float32 copy measured on AVX2 (Zen 3), the bfloat16 one on the Intel machine (AVX-512 BF16). With int16
# activations against a 16-bit copy: never. On Zen 4 (AVX-512 VNNI and BF16, no AMX) the bfloat16 copy ties the
# blocks at 96 rows and a whole prefill on the blocks costs a few percent more than on the copy (at 1K more, at two
# threads), while the copy's bfloat16 weights are one of the roundings that flipped the float32 model's greedy tokens
# at 8000 positions (issue 28): the blocks' exact integer products take every row, and the copy (257 MiB for the
# embedded model) is not held. A pair
# not listed keeps its copy's float32-activations rule: int8 and bf16x2, not measured with their own activations;
# and int16 against the float32 copy, which, though slower than int16's blocks at every row count measured (up to
# 512), is the exact product that the float32 KV configuration holds it for (int16 prefills flipped greedy tokens
# there that the float32 copy does not).
WIDE_ROWS = {(torch.float32, "float32"): 20, (torch.bfloat16, "float32"): 16, (torch.float16, "float32"): 16,
             (torch.bfloat16, "int16"): NEVER, (torch.float16, "int16"): NEVER}


def wide_rows(wide: torch.dtype | None, activations: str) -> float:
    """The rows of x from which a product multiplies through a wide copy in ``wide`` rather than on the blocks
    with ``activations`` (``WIDE_ROWS``); ``NEVER`` for a pair that multiplies on the blocks at every row count, and
    for ``wide`` None (no copy: the blocks)."""
    if wide is None:
        return NEVER
    return WIDE_ROWS.get((wide, activations), WIDE_ROWS[wide, "float32"])


def wide_dtype() -> torch.dtype:
    """The dtype of the quantized formats' dequantized copies: bfloat16 where the CPU multiplies it natively."""
    return torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else torch.float32


def blocks_path(rows: int, wide: torch.dtype | None, activations: str) -> bool:
    """Whether a product over ``rows`` rows of x runs on the blocks (with ``activations``) rather than on a wide
    copy in ``wide``."""
    return rows < wide_rows(wide, activations) and decoder_ops.available()


def uses_wide(wide: torch.dtype | None, activations: str) -> bool:
    """Whether some row count's product runs through a copy in ``wide`` (``blocks_path`` is False for it): a rule
    short of ``NEVER``, or no fused CPU library to run the blocks."""
    return wide_rows(wide, activations) < NEVER or not decoder_ops.available()


def is_blocks(lin) -> bool:
    """Whether ``lin`` holds GGUF blocks (``lin.blocks`` is what the fused layer ops take)."""
    return isinstance(lin, _BlockLinear)


def packed(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight (out, in) reordered once into the blocked layout of oneDNN's GEMM (an opaque mkldnn tensor
    of the same shape and dtype, which ``float_matmul`` takes): torch's ``linear`` reorders the weight on every
    call, a cost that a prefill's few hundred rows do not hide. Its products are ``linear``'s up to the order of
    the sums: bit for bit at tests/server/runtime/test_decoder_weights.py's shape, while at some shapes and row
    counts (the o and down products of a 394-row wave) oneDNN blocks the two layouts' sums differently and the
    last bits differ, within the prefill tests' tolerances. Any other weight, or a torch without oneDNN's bfloat16 path,
    is returned as it is."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not _onednn_bf16():
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


# The rows oneDNN is told to expect when it chooses a packed layout: a prefill wave's order of magnitude. The layout
# it picks for them gave the same products as ``linear`` and was no slower at 16 to 2048 rows.
PACK_ROWS = 512


# The fewest rows from which a packed product whose out features are at most its in features is split by rows over
# the threads (``split_rows``), SPLIT_ROWS rows or more a thread.
SPLIT_ROWS = 32


def split_rows(weight: torch.Tensor, rows: int) -> bool:
    """Whether a packed weight's product over ``rows`` rows runs as one oneDNN call per thread on its share of the
    rows (decoder_ops.packed_linear_rows) rather than as one call threaded by oneDNN: where there are several
    threads and rows enough, for the weights whose out features are at most their in features (the o and down
    products), which oneDNN ran on one thread at a prefill wave's few hundred rows while it split the others itself
    better than this would (figures in docs/bench/history.md, 2026-12-07). Each part's rows are a oneDNN product of
    those rows: the same math, its sums perhaps in another order than one call over all the rows would take (a
    prefill's products already vary so with the rows a forward holds)."""
    threads = torch.get_num_threads()
    return (threads > 1 and rows >= SPLIT_ROWS * threads and weight.shape[0] <= weight.shape[1]
            and decoder_ops.available())


def _onednn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def float_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor | None = None, widen: bool = True, into: bool = False) -> torch.Tensor:
    """x (M, in) float32 @ weight (out, in)^T in the weight's float dtype -> (M, out) float32 (+ bias) (+ residual):
    a dense layer's product, and a quantized one's prefill GEMM through its dequantized copy (plain, or ``packed``).
    The sums with bias and residual widen y inside the add (float32 + bfloat16 is float32, the widening exact),
    with no float32 copy of y first. ``widen=False`` (no residual): y without bias stays in the weight's dtype, for a
    caller that widens what it reads of it (the gate-up product: Decoder's SwiGLU). ``into``: the sum is written into
    ``residual`` and returned (a caller's own residual stream, which it reads only through the result): the same
    values without a new (M, out) tensor per layer."""
    xw = x.to(weight.dtype)  # (M, in)
    if weight.is_mkldnn and split_rows(weight, x.shape[0]):
        y = decoder_ops.packed_linear_rows(xw, weight)  # (M, out) in weight's dtype, a share of rows per thread
    elif weight.is_mkldnn:
        y = torch.ops.mkldnn._linear_pointwise(xw, weight, None, "none", [], "")  # (M, out) in weight's dtype
    else:
        y = torch.nn.functional.linear(xw, weight)  # (M, out) in weight's dtype
    if bias is not None:
        y = torch.add(bias, y)  # (M, out) float32
    if residual is not None:
        return residual.add_(y) if into else torch.add(residual, y)
    return y.float() if widen else y


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

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, widen: bool = True,
                 into: bool = False) -> torch.Tensor:
        return float_matmul(x, self.weight, self.bias, residual, widen, into)  # (M, out)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    def to(self, device: torch.device) -> DenseLinear:
        return DenseLinear(self.weight.to(device), None if self.bias is None else self.bias.to(device))


class _BlockLinear:
    """What the two block formats share: the product (blocks or the wide copy), bytes, the CPU-only rule; each
    format defines ``dequantized``, which the wide copy is made from."""

    format: str
    bits: int

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.qs, self.scales = qs.contiguous(), scales.to(torch.float16).contiguous()
        self.bias = None if bias is None else bias.float().contiguous()
        self.blocks = decoder_ops.Blocks(self.qs, self.scales, self.bits, self.bias)  # what the fused layer ops take
        self.activations = "float32"  # what the block products multiply with (set_activations)
        self.wide_dtype: torch.dtype | None = wide_dtype()  # the prefill GEMM copy's dtype; None: no copy
        self._wide: torch.Tensor | None = None  # (out, in): that copy once made (``wide``)

    def check_activations(self, activations: str) -> None:
        """Raise ValueError if this weight cannot multiply with ``activations`` (decoder_ops.ACTIVATIONS)."""
        decoder_ops.activation_code(activations)
        if activations in decoder_ops.UNIT_ACTIVATIONS and self.out_features % 16:
            raise ValueError(f"activations={activations} needs {self.format} weights with out features a multiple "
                             f"of 16 (units of 16 outputs), got {self.out_features}")

    def set_activations(self, activations: str) -> None:
        """The block products' activations (Decoder.set_activations); ``blocks`` carries what they take: with
        "bf16x2" or "int16", the units in place of qs (decoder_ops.pack_units)."""
        self.check_activations(activations)
        self.activations = activations
        qs = decoder_ops.pack_units(self.qs, self.scales) if activations in decoder_ops.UNIT_ACTIVATIONS else self.qs
        self.blocks = decoder_ops.Blocks(qs, self.scales, self.bits, self.bias)

    def set_wide_dtype(self, dtype: torch.dtype | None) -> None:
        """Multiply from ``wide_rows(dtype, activations)`` rows on through a copy in ``dtype`` (float32: exact
        products, twice the memory of bfloat16), or with None on the blocks at every row count; a copy in another
        dtype is let go, the new one made on first use. None needs the fused CPU library (ValueError)."""
        if dtype is None and not decoder_ops.available():
            raise ValueError(f"{self.format} weights multiply on the blocks only through the fused CPU library, "
                             f"which is not built: give the prefill copy a dtype")
        if dtype != self.wide_dtype:
            self.wide_dtype, self._wide = dtype, None

    @property
    def wide(self) -> torch.Tensor:
        """(out, in) in ``wide_dtype``: the dequantized copy that products from ``wide_rows`` rows on multiply
        through, made (and ``packed``) on first use."""
        if self._wide is None:
            self._wide = packed(self.dequantized().to(self.wide_dtype))
        return self._wide

    def hold_wide(self) -> None:
        """Make the copy now where some row count will use it (``uses_wide``), so that the first prefill does not
        pay for it; let a copy go where none will."""
        self._wide = self.wide if uses_wide(self.wide_dtype, self.activations) else None

    @property
    def wide_nbytes(self) -> int:
        """Bytes the copy holds now: 0 until it is made."""
        return 0 if self._wide is None else self._wide.numel() * self._wide.element_size()

    @property
    def out_features(self) -> int:
        return self.qs.shape[0]

    @property
    def nbytes(self) -> int:
        return self.qs.numel() * self.qs.element_size() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, widen: bool = True,
                 into: bool = False) -> torch.Tensor:
        """x (M, in) float32 -> (M, out) float32 (+ residual); from the wide copy, ``widen=False``: y in its dtype,
        ``into``: the sum written into ``residual`` (float_matmul); the block kernels return a new tensor."""
        if not blocks_path(x.shape[0], self.wide_dtype, self.activations):
            return float_matmul(x, self.wide, self.bias, residual, widen, into)
        b = self.blocks
        return decoder_ops.block_matmul(x.float(), b.qs, b.scales, b.bits, b.bias, residual,
                                        activations=self.activations)  # (M, out)

    def to(self, device: torch.device):
        return _cpu_only(self, device)


class Int4Linear(_BlockLinear):
    format, bits = "int4", 4

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """qs (out, in / 2) uint8 in GGUF's block layout; scales (out, in / 32, 2): (d, m) per block."""
        out = qs.shape[0]
        if qs.dtype != torch.uint8 or scales.shape != (out, qs.shape[1] // 16, 2):
            raise ValueError(f"int4 needs qs (out, in/2) uint8 and scales (out, in/32, 2), got {tuple(qs.shape)} "
                             f"{qs.dtype} and {tuple(scales.shape)}")
        super().__init__(qs, scales, bias)

    @classmethod
    def from_values(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                    bias: torch.Tensor | None = None) -> Int4Linear:
        """q (out, in) in 0..15, d and m (out, in / 32): W = d q + m, packed as GGUF packs Q4_1."""
        blocks = q.to(torch.uint8).view(q.shape[0], -1, 2, 16)  # (out, in/32, halves, 16)
        qs = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).flatten(1)  # (out, in/2)
        return cls(qs, torch.stack([d, m], dim=-1), bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        """Round-to-nearest asymmetric quantization of a float weight (out, in), per block of 32: d = (max - min)
        / 15 and m = min, both rounded to the float16 stored, then q = round((w - m) / d) in 0..15."""
        w = weight.float().unflatten(1, (-1, BLOCK))  # (out, in/32, 32)
        lo, hi = w.amin(-1), w.amax(-1)  # (out, in/32)
        d = ((hi - lo) / 15).clamp_min(1e-7).half().float()
        m = lo.half().float()
        q = ((w - m.unsqueeze(-1)) / d.unsqueeze(-1)).round().clamp(0, 15).flatten(1)
        return cls.from_values(q, d, m, bias)

    def dequantized(self) -> torch.Tensor:
        """(out, in) float32: d q + m, with d q exact in float32 (as the kernel widens them)."""
        blocks = self.qs.view(self.qs.shape[0], -1, 16)  # (out, in/32, 16)
        q = torch.cat([blocks & 15, blocks >> 4], dim=-1).float()  # (out, in/32, 32)
        s = self.scales.float()
        return torch.addcmul(s[..., 1:], q, s[..., :1]).flatten(1)


class Int8Linear(_BlockLinear):
    format, bits = "int8", 8

    def __init__(self, qs: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """qs (out, in) int8; scales (out, in / 32): d per block."""
        if qs.dtype != torch.int8 or scales.shape != (qs.shape[0], qs.shape[1] // BLOCK):
            raise ValueError(f"int8 needs qs (out, in) int8 and scales (out, in/32), got {tuple(qs.shape)} {qs.dtype} "
                             f"and {tuple(scales.shape)}")
        super().__init__(qs, scales, bias)

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """Symmetric quantization per block of 32 (GGUF's Q8_0): d = max |w| / 127 rounded to the float16 stored,
        q = round(w / d)."""
        w = weight.float().unflatten(1, (-1, BLOCK))  # (out, in/32, 32)
        d = (w.abs().amax(-1) / 127).clamp_min(1e-7).half().float()  # (out, in/32)
        q = (w / d.unsqueeze(-1)).round().clamp(-127, 127).flatten(1).to(torch.int8)
        return cls(q, d, bias)

    def dequantized(self) -> torch.Tensor:
        q = self.qs.view(self.qs.shape[0], -1, BLOCK).float()
        return (q * self.scales.float().unsqueeze(-1)).flatten(1)


def _cpu_only(lin, device: torch.device):
    if torch.device(device).type != "cpu":
        raise ValueError(f"{lin.format} weights run on the CPU only (the fused CPU library's block kernels); on "
                         f"{device} use weights=bfloat16 or float16")
    return lin


Linear = DenseLinear | Int4Linear | Int8Linear


def from_float(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> Linear:
    """A float weight (out, in) in ``fmt`` (float32, bfloat16, float16, int8, int4). The block formats need the
    input to be a multiple of 32; other shapes stay float32."""
    if fmt in ("int4", "int8") and weight.shape[1] % BLOCK == 0:
        return (Int4Linear if fmt == "int4" else Int8Linear).quantize(weight, bias)
    if fmt in ("int4", "int8"):
        fmt = "float32"
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[fmt]
    return DenseLinear(weight.detach().to(dtype), None if bias is None else bias.detach())
