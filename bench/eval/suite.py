"""The default evaluation suite on the embedded model, one command, one model load.

Runs, in order, perplexity, needle in a haystack, fidelity, sensitivity + ablation, long horizon (and
LongBench when --longbench-data is given) with settings sized for a 2-core CPU (contexts 2K-4K of
SmolLM2-135M's 8K positions, K = 64 so that K/L = 1/32..1/64 as the paper's K = 512 at 16K-32K),
each writing its markdown/JSON/PNG into <out>/<part>/, then <out>/summary.md: the paper's Table 1
layout (PPL per length, NIAH per length, LongBench) with the path mix, and each part's runtime.

    python -m bench.eval.suite --out results/suite
    python -m bench.eval.suite --out results/gpu --model /models/Qwen2.5-7B-Instruct-1M --device cuda \\
        --dtype bfloat16 --backend triton --top-k 512 --lengths 16384 32768 --scale 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.eval import fidelity, long_horizon, longbench, niah, perplexity, sweep
from bench.eval.common import DEFAULT_TOP_K, MIX_KEYS, add_model_args, make_runner, markdown_table

PARTS = ("perplexity", "niah", "fidelity", "sweep", "long_horizon", "longbench")
METHODS = "full,exact_topk,retopk,retopk:tau=0.9,streaming_llm,quest,sparq,loki,tokenselect"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="context lengths (PPL, NIAH)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every step/document count (0.25 = quick)")
    p.add_argument("--parts", default=",".join(PARTS[:-1]), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--longbench-data", type=Path, default=None, help="LongBench JSONL folder (part 'longbench')")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def n(value: float, scale: float, low: int = 1) -> int:
    return max(low, round(value * scale))


def part_argv(part: str, args) -> list[str]:
    s, Ls, K = args.scale, [str(v) for v in args.lengths], str(args.top_k)
    base = ["--model", args.model, "--device", args.device, "--weights", args.weights, "--kv-dtype", args.kv_dtype,
            "--activations", args.activations, "--backend", args.backend,
            "--corpus", args.corpus, "--threads", str(args.threads), "--out", str(args.out / part)]
    if args.rope_scaling:
        base += ["--rope-scaling", args.rope_scaling]
    long_L = str(max(args.lengths))
    return base + {
        "perplexity": ["--methods", args.methods, "--top-k", K, "--lengths", *Ls, "--docs", str(n(1, s)),
                       "--suffix", str(n(128, s, 8))],
        "niah": ["--methods", args.methods, "--top-k", K, "--lengths", *Ls, "--depths", str(n(2, s, 2)),
                 "--needles", "3"],
        "fidelity": ["--methods", "retopk,exact_topk,streaming_llm", "--top-k", K, "--length", long_L,
                     "--docs", str(n(1, s)), "--suffix", str(n(80, s, 8))],
        "sweep": ["--top-k", K, "--length", long_L, "--docs", str(n(1, s)), "--suffix", str(n(80, s, 8))],
        "long_horizon": ["--top-k", K, "--prefill", long_L, "--continuation", str(n(256, s, 16)),
                         "--refresh", "0,32,128", "--docs", str(n(1, s))],
        "longbench": ["--methods", args.methods, "--top-k", K, "--data", str(args.longbench_data)],
    }[part]


def main(argv=None) -> dict:
    args = parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    if "longbench" in parts and args.longbench_data is None:
        raise SystemExit("part 'longbench' needs --longbench-data")
    t0 = time.time()
    runner = make_runner(args)
    load_s = time.time() - t0
    modules = {"perplexity": perplexity, "niah": niah, "fidelity": fidelity, "sweep": sweep,
               "long_horizon": long_horizon, "longbench": longbench}
    results, seconds = {}, {"model load": load_s}
    for part in parts:
        t = time.time()
        print(f"== {part}: python -m bench.eval.{part} " + " ".join(part_argv(part, args)), flush=True)
        argv0, sys.argv = sys.argv, [f"bench/eval/{part}.py", *part_argv(part, args)]  # each part records its command
        try:
            results[part] = modules[part].main(part_argv(part, args), runner=runner)
        finally:
            sys.argv = argv0
        seconds[part] = time.time() - t
        write_summary(args, results, seconds, time.time() - t0)
    return results


def write_summary(args, results: dict, seconds: dict, total: float) -> None:
    """<out>/summary.md + summary.json: Table 1's layout from whatever parts have finished."""
    labels = [r["method"] for r in results.get("perplexity", {}).get("rows", [])] or \
        [r["method"] for r in results.get("niah", {}).get("rows", [])]
    by = {part: {r["method"]: r for r in res.get("rows", [])} for part, res in results.items()
          if part in ("perplexity", "niah", "longbench")}
    rows, cols = [], [("method", "method", "")]
    Ls = args.lengths
    if "perplexity" in by:
        cols += [(f"ppl_{L}", f"PPL {L}", ".3f") for L in Ls] + [(f"dppl_{L}", f"ΔPPL {L}", "%") for L in Ls]
    if "niah" in by:
        cols += [(f"avg_{L}", f"NIAH {L}", ".1f") for L in Ls]
    if "longbench" in by:
        cols += [("lb_avg", "LongBench", ".1f")]
    if "perplexity" in by:
        L = Ls[-1]
        cols += [(f"reuse_{L}", f"reuse {L}", "%"), (f"promoted_{L}", f"promoted {L}", "%"),
                 (f"exact_path_{L}", f"exact path {L}", "%"), (f"group_read_{L}", f"group reads {L}", "%"),
                 (f"mean_candidates_{L}", f"M_t {L}", ".1f")]
    for label in labels:
        row = {"method": label}
        for part, per in by.items():
            src = per.get(label, {})
            for k, v in src.items():
                if k == "method" or (part != "perplexity" and (k in MIX_KEYS or k.rpartition("_")[0] in MIX_KEYS)):
                    continue  # the path mix shown is the perplexity run's
                row["lb_avg" if (part == "longbench" and k == "avg") else k] = v
        rows.append(row)
    times = [{"part": k, "seconds": v} for k, v in seconds.items()] + [{"part": "total", "seconds": total}]
    md = ["# Evaluation suite summary", "", f"K = {args.top_k}, lengths {Ls}, scale {args.scale}, model {args.model}",
          "", markdown_table(rows, cols), "", markdown_table(times, [("part", "part", ""), ("seconds", "s", ".0f")]),
          ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text("\n".join(md), encoding="utf-8")
    (args.out / "summary.json").write_text(json.dumps({"rows": rows, "seconds": seconds, "total": total},
                                                      indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
