"""The block products of a decode step (decoder_ops.block_matmul) at the embedded model's shapes, with float32
and int8 activations (RuntimeConfig.activations), taking turns in one process so that a loaded machine's drift
falls on both alike.

Per shape (out x in, weight format), rows M and thread count: the median of ``--reps`` calls, each way timed in
``--rounds`` alternating turns; printed with float32 / int8 (the int8 path's speed-up) and, for M > 1, the batch's
time against M single-row calls of the same way (how much a batch shares each weight block). Then, per M > 1 and
thread count, the chosen products as a decode step runs them (``LAYERS`` times each layer product, the LM head
once): M rows' time against one row's, which bounds what M streams can gain over one (M / that ratio, with
everything else in the step free), and the multiply-adds per second at M rows (M x ``step_macs`` / time),
to set against the CPU's float32 FMA peak.

    python -m bench.block_products --threads 1 2 --rows 1 8
    python -m bench.block_products --threads 1 --rows 8     # the step's ratio at 8 rows, one thread
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from retopk_core.cpu import decoder_ops
from retopk_server.runtime.decoder.linear import from_float

# SmolLM2-135M's products: QKV, o, gate-up, down (Q4_1 as stored) and the tied LM head (Q8_0)
SHAPES = (("qkv", 960, 576, "int4"), ("o", 576, 576, "int4"), ("gate_up", 3072, 576, "int4"),
          ("down", 576, 1536, "int4"), ("lm_head", 49152, 576, "int8"))
LAYERS = 30  # SmolLM2-135M's decoder layers: a decode step runs each layer product 30 times, the LM head once


def step_count(name: str) -> int:
    """How many times a decode step runs the product ``name``."""
    return 1 if name == "lm_head" else LAYERS


def step_macs(shapes) -> int:
    """Multiply-adds of one row through the products ``shapes`` as a step runs them (out x in each)."""
    return sum(step_count(name) * out * n_in for name, out, n_in, _ in shapes)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--reps", type=int, default=50, help="calls per timed turn")
    p.add_argument("--rounds", type=int, default=5, help="alternating turns of each way")
    return p.parse_args(argv)


def per_call(lin, x: torch.Tensor, activations: str, reps: int) -> float:
    """Median seconds of one block_matmul call over ``reps`` calls."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        decoder_ops.block_matmul(x, lin.qs, lin.scales, lin.bits, lin.bias, activations=activations)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    print(f"{'shape':>8} {'out x in':>11} {'M':>2} {'thr':>3} {'f32 us':>8} {'int8 us':>8} {'f32/int8':>8} "
          f"{'f32 M/(M x 1)':>13} {'int8 M/(M x 1)':>14}")
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    lins = {name: from_float(torch.randn(out, n_in) * 0.05, None, fmt) for name, out, n_in, fmt in shapes}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name, out, n_in, _ in shapes:
            lin = lins[name]
            for M in args.rows:
                x, x1 = torch.randn(M, n_in), torch.randn(1, n_in)
                t = {(a, m): [] for a in decoder_ops.ACTIVATIONS for m in {M, 1}}
                for _ in range(args.rounds):
                    for a, m in t:
                        t[(a, m)].append(per_call(lin, x if m == M else x1, a, args.reps))
                med = {k: statistics.median(v) for k, v in t.items()}
                r = {"shape": name, "out": out, "in": n_in, "M": M, "threads": threads,
                     "float32_s": med[("float32", M)], "int8_s": med[("int8", M)],
                     "batch_vs_rows_float32": med[("float32", M)] / (M * med[("float32", 1)]),
                     "batch_vs_rows_int8": med[("int8", M)] / (M * med[("int8", 1)])}
                rows.append(r)
                print(f"{name:>8} {out:>5} x {n_in:<4} {M:>2} {threads:>3} {1e6 * r['float32_s']:>8.1f} "
                      f"{1e6 * r['int8_s']:>8.1f} {r['float32_s'] / r['int8_s']:>8.2f} "
                      f"{r['batch_vs_rows_float32']:>13.2f} {r['batch_vs_rows_int8']:>14.2f}")
        for M in (m for m in args.rows if m > 1):
            print_step([r for r in rows if r["threads"] == threads and r["M"] == M], shapes)
    return rows


def print_step(rows: list[dict], shapes) -> None:
    """The rows' products (one M, one thread count) as a decode step runs them: M rows' time / one row's, and the
    multiply-adds per second at M rows, per activation way."""
    M, threads, macs = rows[0]["M"], rows[0]["threads"], step_macs(shapes)
    parts = []
    for a in ("float32", "int8"):
        many = sum(step_count(r["shape"]) * r[f"{a}_s"] for r in rows)
        one = sum(step_count(r["shape"]) * r[f"{a}_s"] / (M * r[f"batch_vs_rows_{a}"]) for r in rows)
        parts.append(f"{a} {1e3 * many:.1f} / {1e3 * one:.1f} ms = {many / one:.2f}x "
                     f"({M * macs / many / 1e9:.1f} G multiply-adds/s)")
    print(f"a step's products, {M} rows / 1 row, {threads} thread(s): " + "; ".join(parts))


if __name__ == "__main__":
    main()
