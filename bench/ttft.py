"""Time to first token of a short chat turn: the prefill of one chat prompt, per method, same process.

A chat prompt (the model's chat template around ``--message``) is prefilled into a fresh session by
each method in turn, for several rounds; the median wall time of the prefill (which yields the first
token's logits) is reported with its ratio to Full attention. For ReTopK the prefill also seeds the
query-support FIFO of every layer (or skips it below the dense floor), which is the cost measured here.

    python -m bench.ttft --threads 2 --rounds 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path as FsPath
from typing import TYPE_CHECKING

from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.models import DEFAULT_MODEL

# torch and what imports it load inside the functions: main() first asks for huge pages, which must
# precede torch's first allocation (retopk_core/hugepages.py), and importing this module changes nothing.
if TYPE_CHECKING:
    from retopk_server.runtime import ModelRunner

DEFAULT_METHODS = ["full", "retopk:top_k=64", "default"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint path")
    p.add_argument("--message", default="Write a short story about a lighthouse keeper and a storm.",
                   help="the user message of the chat turn")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help='method specs "name[:key=value,...]" or "default" (default: %(default)s)')
    p.add_argument("--rounds", type=int, default=15, help="rounds in which the methods take turns (first untimed)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json")
    return p.parse_args(argv)


def run(runner: ModelRunner, specs: list, ids: list[int], rounds: int) -> list[dict]:
    """Median prefill seconds per method over ``rounds`` - 1 timed rounds (the first warms up)."""
    from bench.e2e_cpu import _label

    times: list[list[float]] = [[] for _ in specs]
    for r in range(rounds):
        for i, spec in enumerate(specs):
            session = runner.open_session(spec)
            t0 = time.perf_counter()
            runner.prefill(session, ids)
            elapsed = time.perf_counter() - t0
            runner.close_session(session)
            if r:
                times[i].append(elapsed)
    rows = [{"method": s.describe(), "label": _label(s), "prompt_tokens": len(ids),
             "ttft_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)} for s, t in zip(specs, times, strict=True)]
    full = next((r for r in rows if r["method"]["method"] == "full"), None)
    for r in rows:
        r["vs_full"] = r["ttft_ms"] / full["ttft_ms"] if full else None
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2 (the first round is untimed)")
    enable_transparent_hugepages()  # before torch is imported: see retopk_core/hugepages.py
    import torch

    from bench.e2e_cpu import parse_method
    from retopk_server.runtime import ModelRunner, RuntimeConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [parse_method(m) for m in args.methods]
    runner = ModelRunner(RuntimeConfig(model=args.model, default_method=specs[0]))
    ids = runner.tokenizer.apply_chat_template([{"role": "user", "content": args.message}],
                                               add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        rows = run(runner, specs, list(ids), args.rounds)
    print(f"# ttft: {args.model}, {len(ids)} prompt tokens, {torch.get_num_threads()} threads, "
          f"{args.rounds - 1} timed rounds")
    print("| method | TTFT (median) | min | vs Full |\n|---|---|---|---|")
    for r in rows:
        ratio = "" if r["vs_full"] is None else f"{r['vs_full']:.2f}x"
        print(f"| {r['label']} | {r['ttft_ms']:.1f} ms | {r['min_ms']:.1f} ms | {ratio} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
