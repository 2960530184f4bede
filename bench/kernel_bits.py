"""The fused CPU kernel's dense outputs and the decoder's block products, recorded by one build and compared bit
for bit with another's.

A change to retopk_cpu.cpp that must keep every sum's order (a prefetch, a register blocking) is checked by
recording with the library before it and with the library after it, each from its own checkout and build, then
comparing: ``torch.equal`` on every output, not a tolerance. The cases are ``launch.dense_decode`` in its three
modes (Full attention, split along the keys; Full attention with each head's Top-K, the dense floor's pass; Exact
Top-K, the exact pass of ReTopK's fallback and refresh heads) over float32 / bfloat16 / float16 pools, head dims
with d % 8 != 0 and d % 16 == 8, 1 to 7 query heads per KV head, shuffled blocks of 16 to 256 positions (some not
powers of two), lengths up to 4096. Beside them, ``decoder_ops.block_matmul`` with float32 activations at the
embedded model's product shapes (bench.block_products.SHAPES), each in both block formats (Q4_1 and Q8_0), with a
bias and a residual, for 1 to 9 rows of x (one and two passes of the loops' rows), at AVX2 and at the CPU's best
level, and the same with int16 activations (on pack_units's units). The inputs depend on the seeds alone. The bits
also depend on the clone the CPU picks (x86-64-v3 or the baseline): compare records made on the same machine.

    (in the baseline checkout) python -m bench.kernel_bits record /tmp/before.pt
    (in the changed checkout)  python -m bench.kernel_bits record /tmp/after.pt
    python -m bench.kernel_bits compare /tmp/before.pt /tmp/after.pt   # exit status 1 when any output differs
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from retopk_core.kv import PagedKV

# (B, H, H_kv, d, block, lengths)
CASES = [(2, 4, 4, 16, 16, [5, 300]), (3, 9, 3, 64, 256, [5, 300, 37]), (2, 14, 2, 24, 100, [5, 300]),
         (4, 9, 3, 64, 100, [1500, 513, 512, 7]), (2, 9, 3, 64, 256, [4096, 1100]), (2, 8, 2, 72, 48, [700, 90]),
         (2, 6, 3, 60, 32, [333, 65]), (1, 12, 2, 128, 64, [2000])]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MODES = ("full", "full+topk", "exact")
PRODUCT_ROWS = tuple(range(1, 10))


def shuffled_pool(B: int, H_kv: int, d: int, block: int, lengths: list[int], dtype: torch.dtype,
                  g: torch.Generator) -> PagedKV:
    """Random keys and values in a pool (B * nb, H_kv, block, d) whose blocks the table maps in shuffled order."""
    nb = -(-max(lengths) // block)
    k_pool = torch.randn(B * nb, H_kv, block, d, generator=g).to(dtype)
    v_pool = torch.randn(B * nb, H_kv, block, d, generator=g).to(dtype)
    table = torch.randperm(B * nb, generator=g).view(B, nb)
    return PagedKV(k_pool, v_pool, table, torch.tensor(lengths))


def record(cases=CASES, dtypes=DTYPES) -> dict[str, torch.Tensor]:
    """Every case's outputs by name: out (B, H, dv) and, with a Top-K, the selected positions sorted per head."""
    from retopk_core.cpu import launch

    outputs = {}
    for dtype in dtypes:
        for i, (B, H, H_kv, d, block, lengths) in enumerate(cases):
            g = torch.Generator().manual_seed(i)
            kv = shuffled_pool(B, H_kv, d, block, lengths, dtype, g)
            q = torch.randn(B, H, d, generator=g)
            for mode in MODES:
                top_k = 0 if mode == "full" else 16
                out, sel = launch.dense_decode(q, kv, 1 / math.sqrt(d), top_k, exact=mode == "exact")
                name = f"{str(dtype).removeprefix('torch.')} B{B} H{H} Hkv{H_kv} d{d} block{block} {mode}"
                outputs[f"{name} out"] = out
                if sel is not None:
                    outputs[f"{name} selected"] = sel.sort(-1).values
    return outputs


def record_products(shapes=None, rows=PRODUCT_ROWS) -> dict[str, torch.Tensor]:
    """block_matmul's outputs y (M, out) = x W^T + b + residual by name, float32 and int16 activations, for every
    shape of ``shapes`` (default bench.block_products.SHAPES) in both block formats, every M of ``rows``, at AVX2
    and at the CPU's best level (just the plain loops where the CPU has no AVX2)."""
    from bench.block_products import SHAPES
    from retopk_core.cpu import decoder_ops
    from retopk_server.runtime.decoder.linear import from_float

    best = decoder_ops.best_isa()
    levels = sorted({min(1, best), best})
    outputs = {}
    for i, (name, out, n_in, _) in enumerate(shapes or SHAPES):
        g = torch.Generator().manual_seed(100 + i)
        w, b = torch.randn(out, n_in, generator=g) * 0.05, torch.randn(out, generator=g)
        x, res = torch.randn(max(rows), n_in, generator=g), torch.randn(max(rows), out, generator=g)
        for fmt in ("int4", "int8"):
            lin = from_float(w, b, fmt)
            units = decoder_ops.pack_units(lin.qs, lin.scales)
            for M in rows:
                for level in levels:
                    at = f"{name} {out}x{n_in} {fmt} M{M} {decoder_ops.ISA_NAMES[level]}"
                    y = decoder_ops.block_matmul(x[:M], lin.qs, lin.scales, lin.bits, lin.bias, res[:M].contiguous(),
                                                 level, "float32")
                    outputs[f"block_matmul {at}"] = y
                    outputs[f"block_matmul int16 {at}"] = decoder_ops.block_matmul(
                        x[:M], units, lin.scales, lin.bits, lin.bias, res[:M].contiguous(), level, "int16")
    return outputs


def differing(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors are not the same bits (or that one record lacks)."""
    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("record", help="write this checkout's outputs").add_argument("path")
    c = sub.add_parser("compare", help="compare two records bit for bit")
    c.add_argument("before")
    c.add_argument("after")
    args = p.parse_args(argv)
    if args.command == "record":
        torch.set_num_threads(2)  # several tasks per call, as the server runs them (the bits do not depend on it)
        outputs = {**record(), **record_products()}
        torch.save(outputs, args.path)
        print(f"kernel_bits: {len(outputs)} outputs -> {args.path}")
        return 0
    a, b = torch.load(args.before), torch.load(args.after)
    bad = differing(a, b)
    print(f"kernel_bits: {len(set(a) | set(b))} outputs, {len(bad)} differ" + "".join(f"\n  {n}" for n in bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
