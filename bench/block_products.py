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

With one thread a call's time is the CPU time of the calling thread (``time.thread_time``; the library runs a
one-thread call on it), which a loaded machine's other work does not inflate; with more, wall time.
``--int8-isa`` times the int8 way at each of the named SIMD levels (decoder_ops.ISA_NAMES, up to the CPU's best)
as separate ways taking turns with the others, e.g. AVX2's int8 loop (which level avx512 runs) against AVX-512
VNNI's: per shape the first level's time / each other's. ``--bf16x2`` adds bf16x2 activations (AMX tiles, every
product on decoder_ops.pack_units's units) as a way taking turns too, printed in the int8 columns' place after them
(int8's time / bf16x2's) and in the step's lines; ``--int16`` adds int16 activations (exact integer block dots on
the same units: AVX-512 VNNI's dpwssd where the CPU has it) the same way.

    python -m bench.block_products --threads 1 2 --rows 1 8
    python -m bench.block_products --threads 1 --rows 8     # the step's ratio at 8 rows, one thread
    python -m bench.block_products --threads 1 --rows 1 8 --int8-isa avx512 avx512_vnni
    python -m bench.block_products --threads 1 2 --rows 1 8 --bf16x2
    python -m bench.block_products --threads 1 2 --rows 1 8 --int16
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
    p.add_argument("--int8-isa", nargs="+", choices=decoder_ops.ISA_NAMES,
                   help="time the int8 way at each of these SIMD levels (default: the ops' own level)")
    p.add_argument("--bf16x2", action="store_true", help="time bf16x2 activations too (needs AMX-BF16)")
    p.add_argument("--int16", action="store_true", help="time int16 activations too")
    return p.parse_args(argv)


def ways(int8_isa: list[str] | None, bf16x2: bool = False, int16: bool = False) -> dict[str, tuple[str, int | None]]:
    """The timed ways, name -> (activations, SIMD level or None for the ops' own): float32, then int8 once or at
    each level of ``int8_isa`` (named "int8 LEVEL"), then bf16x2 with ``bf16x2``, then int16 with ``int16``."""
    if bf16x2 and not decoder_ops.amx_available():
        raise SystemExit("--bf16x2: this CPU has no AMX-BF16")
    extra = {a: (a, None) for a, on in (("bf16x2", bf16x2), ("int16", int16)) if on}
    if not int8_isa:
        return {"float32": ("float32", None), "int8": ("int8", None), **extra}
    best = decoder_ops.best_isa()
    for name in int8_isa:
        if decoder_ops.ISA_NAMES.index(name) > best:
            raise SystemExit(f"--int8-isa {name}: this CPU's best level is {decoder_ops.ISA_NAMES[best]}")
    return {"float32": ("float32", None), **{f"int8 {n}": ("int8", decoder_ops.ISA_NAMES.index(n)) for n in int8_isa},
            **extra}


def per_call(lin, x: torch.Tensor, way: tuple[str, int | None], reps: int, clock) -> float:
    """Median seconds of one block_matmul call over ``reps`` calls, on ``clock``."""
    activations, level = way
    qs = lin.units if activations in decoder_ops.UNIT_ACTIVATIONS else lin.qs  # pack_units's, set in main
    times = []
    for _ in range(reps):
        start = clock()
        decoder_ops.block_matmul(x, qs, lin.scales, lin.bits, lin.bias, None, level, activations)
        times.append(clock() - start)
    return statistics.median(times)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    named = ways(args.int8_isa, args.bf16x2, args.int16)
    int8 = [w for w in named if w != "float32"]
    units = [w for w in named if w in decoder_ops.UNIT_ACTIVATIONS]  # the ways on pack_units's units
    print(f"{'shape':>8} {'out x in':>11} {'M':>2} {'thr':>3} {'f32 us':>8} "
          + " ".join(f"{w + ' us':>{max(8, len(w) + 3)}}" for w in int8)
          + f" {'f32/int8':>8}" + "".join(f" {int8[0] + '/' + w:>{len(int8[0]) + len(w) + 1}}" for w in int8[1:])
          + f" {'f32 M/(M x 1)':>13} {'int8 M/(M x 1)':>14}" + "".join(f" {w + ' M/(M x 1)':>16}" for w in units))
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    lins = {name: from_float(torch.randn(out, n_in) * 0.05, None, fmt) for name, out, n_in, fmt in shapes}
    for lin in lins.values():
        if units:
            lin.units = decoder_ops.pack_units(lin.qs, lin.scales)
    for threads in args.threads:
        torch.set_num_threads(threads)
        clock = time.thread_time if threads == 1 else time.perf_counter
        for name, out, n_in, _ in shapes:
            lin = lins[name]
            for M in args.rows:
                x, x1 = torch.randn(M, n_in), torch.randn(1, n_in)
                t = {(w, m): [] for w in named for m in {M, 1}}
                for _ in range(args.rounds):
                    for w, m in t:
                        t[(w, m)].append(per_call(lin, x if m == M else x1, named[w], args.reps, clock))
                med = {k: statistics.median(v) for k, v in t.items()}
                r = {"shape": name, "out": out, "in": n_in, "M": M, "threads": threads,
                     "clock": "thread CPU" if threads == 1 else "wall",
                     **{f"{w.replace(' ', '_')}_s": med[(w, M)] for w in named},
                     **{f"batch_vs_rows_{w.replace(' ', '_')}": med[(w, M)] / (M * med[(w, 1)]) for w in named}}
                if int8[0] != "int8":  # the first int8 level's figures as the int8 way's, as without --int8-isa
                    first = int8[0].replace(" ", "_")
                    r["int8_s"], r["batch_vs_rows_int8"] = r[f"{first}_s"], r[f"batch_vs_rows_{first}"]
                rows.append(r)
                print(f"{name:>8} {out:>5} x {n_in:<4} {M:>2} {threads:>3} {1e6 * r['float32_s']:>8.1f} "
                      + " ".join(f"{1e6 * med[(w, M)]:>{max(8, len(w) + 3)}.1f}" for w in int8)
                      + f" {r['float32_s'] / r['int8_s']:>8.2f}"
                      + "".join(f" {med[(int8[0], M)] / med[(w, M)]:>{len(int8[0]) + len(w) + 1}.2f}" for w in int8[1:])
                      + f" {r['batch_vs_rows_float32']:>13.2f} {r['batch_vs_rows_int8']:>14.2f}"
                      + "".join(f" {r[f'batch_vs_rows_{w}']:>16.2f}" for w in units))
        for M in (m for m in args.rows if m > 1):
            print_step([r for r in rows if r["threads"] == threads and r["M"] == M], shapes, named)
        print_step_totals([r for r in rows if r["threads"] == threads], shapes, named)
    return rows


def print_step(rows: list[dict], shapes, named) -> None:
    """The rows' products (one M, one thread count) as a decode step runs them: M rows' time / one row's, and the
    multiply-adds per second at M rows, per way."""
    M, threads, macs = rows[0]["M"], rows[0]["threads"], step_macs(shapes)
    parts = []
    for w in named:
        key = w.replace(" ", "_")
        many = sum(step_count(r["shape"]) * r[f"{key}_s"] for r in rows)
        one = sum(step_count(r["shape"]) * r[f"{key}_s"] / (M * r[f"batch_vs_rows_{key}"]) for r in rows)
        parts.append(f"{w} {1e3 * many:.1f} / {1e3 * one:.1f} ms = {many / one:.2f}x "
                     f"({M * macs / many / 1e9:.1f} G multiply-adds/s)")
    print(f"a step's products, {M} rows / 1 row, {threads} thread(s): " + "; ".join(parts))


def print_step_totals(rows: list[dict], shapes, named) -> None:
    """Per M, the chosen products as a decode step runs them, in each way (ms), when several int8 levels are timed."""
    if len(named) < 3:
        return
    for M in sorted({r["M"] for r in rows}):
        total = {w: sum(step_count(r["shape"]) * r[f"{w.replace(' ', '_')}_s"] for r in rows if r["M"] == M)
                 for w in named}
        first = [w for w in named if w != "float32"][0]
        print(f"a step's products at {M} row(s), {rows[0]['threads']} thread(s): "
              + ", ".join(f"{w} {1e3 * v:.2f} ms" for w, v in total.items())
              + "; " + ", ".join(f"{first} / {w} {total[first] / total[w]:.3f}"
                                 for w in named if w not in ("float32", first)))


if __name__ == "__main__":
    main()
