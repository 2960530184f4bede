"""Where a quantized linear's product should leave the block kernels for its dequantized copy's GEMM.

For M rows of x, times the four matmuls of every decoder layer of the served model (QKV, O, gate-up, down, as
loaded with the server's default weights; all layers, so that the weights come from memory as in a forward,
not from the cache as one layer's would) each way, taking turns in rounds in one process: the fused CPU
library's ``block_matmul`` on the GGUF blocks with each of ``--activations`` (default "auto", what the server
resolves it to: Decoder.auto_activations), and the GEMM on the ``wide`` copy as the server runs it (float_matmul)
in each dtype this CPU multiplies natively (float32 always; bfloat16 where it has AVX-512 BF16). Prints the median
ms per layer and the ratio blocks / wide per M and activations; decoder/linear.py's ``WIDE_ROWS`` for a
(wide dtype, activations) pair is the first M where the wide copy wins.

    python -m bench.wide_rows --rows 8 16 24 32 48 64 128 --threads 2 --activations int16 float32
    python -m bench.wide_rows --threads 1 --clock cpu     # on a loaded machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path as FsPath

import torch

from retopk_core.cpu import decoder_ops
from retopk_server.runtime.decoder.linear import float_matmul, wide_dtype
from retopk_server.runtime.loading import load
from retopk_server.runtime.runtime_config import ACTIVATION_CHOICES, RuntimeConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 24, 32, 48, 64, 128])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=20, help="products per timing")
    p.add_argument("--activations", nargs="+", choices=ACTIVATION_CHOICES, default=["auto"],
                   help="the block products' activations, each timed in turns (auto: as the server resolves it)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU time (with --threads 1, the work alone on a loaded machine)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json")
    return p.parse_args(argv)


def timed(fn, reps: int, clock) -> float:
    """Milliseconds per call of ``fn`` on ``clock``, over ``reps`` calls after one warm-up."""
    fn()
    t0 = clock()
    for _ in range(reps):
        fn()
    return (clock() - t0) / reps * 1e3


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    if not decoder_ops.available():
        raise SystemExit("the fused CPU library is not built: python -m retopk_core.cpu.build")
    decoder = load(RuntimeConfig().model, RuntimeConfig().weight_format(), None).decoder
    layers = decoder.layers
    lins = [lin for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    blocks_of = {}  # activations -> each lin's Blocks (bf16x2's and int16's hold the weights as units)
    for act in decoder.resolve_activations(args.activations):
        decoder.set_activations(act)
        blocks_of[act] = [lin.blocks for lin in lins]
    dtypes = [torch.float32] + ([torch.bfloat16] if wide_dtype() == torch.bfloat16 else [])
    wides = {dt: [lin.wide if lin.wide_dtype == dt else lin.dequantized().to(dt) for lin in lins]
             for dt in dtypes}  # (out, in) each
    rows = []
    for M in args.rows:
        xs = [torch.randn(M, lin.qs.shape[1] * 8 // lin.bits) for lin in lins]  # (M, in) each

        def blocks(act, xs=xs):
            return lambda: [decoder_ops.block_matmul(x, b.qs, b.scales, b.bits, b.bias, activations=act)
                            for b, x in zip(blocks_of[act], xs, strict=True)]

        def wide(dt, xs=xs):
            return lambda: [float_matmul(x, w, lin.bias) for lin, x, w in zip(lins, xs, wides[dt], strict=True)]

        block_ways = {f"blocks_{act}": blocks(act) for act in blocks_of}
        wide_ways = {f"wide_{str(dt).removeprefix('torch.')}": wide(dt) for dt in dtypes}
        ways = {**block_ways, **wide_ways}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(args.rounds):  # turns, so that a change of load falls on every way alike
            for name, fn in ways.items():
                times[name].append(timed(fn, args.reps, clock))
        row = {"rows": M, **{f"{k}_ms": statistics.median(v) / len(layers) for k, v in times.items()}}  # a layer
        for b in block_ways:
            for w in wide_ways:
                row[f"{b}_over_{w}"] = row[f"{b}_ms"] / row[f"{w}_ms"]
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
