"""End-to-end decode speed: ms per generated token with a real model at growing contexts.

For each context length L the same prompt (the first L tokens of a text) is prefilled once per
method, then N tokens are decoded greedily through the runtime; reported are ms/token, the share of
it spent in the attention core (from the runtime's per-step stats), and transformers' own
``generate`` on the same model and prompt as the outside baseline (its per-token time is
(t(N+1 tokens) - t(1 token)) / N, so its prefill cancels). All in one process.

    python bench/e2e_cpu.py --lengths 1024 2048 4096 8000 --new-tokens 32
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages

enable_transparent_hugepages()  # before torch allocates anything: see retopk_core/hugepages.py

import torch

from bench.eval.common import load_corpus
from retopk_server.cli import parse_params
from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig

DEFAULT_METHODS = ["full", "exact_topk:top_k=64", "retopk:top_k=64"]


def parse_method(text: str) -> MethodSpec:
    """"name" or "name:key=value,key=value" -> MethodSpec (values parsed as the server's CLI does)."""
    name, _, rest = text.partition(":")
    return MethodSpec.of(name, **parse_params(rest))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name or local checkpoint path")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--new-tokens", type=int, default=32, help="decoded tokens timed per method and length")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help='method specs "name[:key=value,...]" (default: %(default)s)')
    p.add_argument("--corpus", default="kjv", help="prompt text file, or 'kjv' for the King James Bible (default)")
    p.add_argument("--no-generate", action="store_true", help="skip transformers' generate baseline")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json and <out>.png")
    return p.parse_args(argv)


def time_runner(runner: ModelRunner, spec: MethodSpec, prompt: list[int], n: int) -> dict:
    """Prefill once, decode n greedy tokens; per-token wall time and the attention core's share."""
    session = runner.open_session(spec)
    try:
        tok = int(runner.prefill(session, prompt).argmax())
        runner.decode([session], [tok])  # warm-up step, not timed
        total = attn = 0.0
        paths: dict[str, int] = {}
        for _ in range(n):
            t0 = time.perf_counter()
            logits, stats = runner.decode([session], [tok], with_stats=True)
            total += time.perf_counter() - t0
            tok = int(logits[0].argmax())
            attn += stats[0].attention_s
            for k, v in stats[0].counts().items():
                paths[k] = paths.get(k, 0) + v
    finally:
        runner.close_session(session)
    return {"ms_per_token": 1e3 * total / n, "attention_share": attn / total, "paths": paths}


def time_generate(model, prompt: list[int], n: int) -> float:
    """transformers' generate, greedy, ms per token with its prefill subtracted."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def run(k: int) -> float:
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    run(1)  # warm-up
    return 1e3 * (run(n + 1) - run(1)) / n


def run(runner: ModelRunner, specs: list[MethodSpec], ids: list[int], lengths: list[int], n: int,
        with_generate: bool = True) -> list[dict]:
    """Every method (and transformers' generate) at every length on the prompt ids[:L]."""
    rows = []
    for L in lengths:
        prompt = ids[:L]
        for spec in specs:
            r = time_runner(runner, spec, prompt, n)
            rows.append({"L": L, "method": spec.describe(), "label": _label(spec), **r})
        if with_generate:
            with torch.inference_mode():
                ms = time_generate(runner.model, prompt, n)
            rows.append({"L": L, "method": {"method": "transformers.generate"}, "label": "transformers generate",
                         "ms_per_token": ms, "attention_share": None, "paths": {}})
        exact = [r for r in rows if r["L"] == L and r["method"]["method"] == "exact_topk"]
        for r in rows:
            if r["L"] == L:
                r["speedup_vs_exact"] = exact[0]["ms_per_token"] / r["ms_per_token"] if exact else None
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    specs = [parse_method(m) for m in args.methods]
    runner = ModelRunner(RuntimeConfig(model=args.model, default_method=specs[0]))
    ids = runner.encode(load_corpus(args.corpus)[:8 * max(args.lengths)], add_special_tokens=False)  # ~4 chars a token
    if len(ids) < max(args.lengths):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the longest length {max(args.lengths)}")
    print(f"# e2e_cpu: {args.model}, {runner.info.num_layers} layers, {torch.get_num_threads()} threads, "
          f"{args.new_tokens} tokens per point", flush=True)
    rows = run(runner, specs, ids, args.lengths, args.new_tokens, not args.no_generate)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))
        plot(rows, args.out.with_suffix(".png"))
    return rows


def _label(spec: MethodSpec) -> str:
    params = ",".join(f"{k}={v}" for k, v in spec.params)
    return spec.name + (f"({params})" if params else "")


def table(rows: list[dict]) -> str:
    lines = ["| L | method | ms/token | attention share | vs Exact Top-K | paths |", "|---|---|---|---|---|---|"]
    for r in rows:
        share = "" if r["attention_share"] is None else f"{100 * r['attention_share']:.0f}%"
        ratio = "" if r.get("speedup_vs_exact") is None else f"{r['speedup_vs_exact']:.2f}x"
        total = sum(r["paths"].values()) or 1
        mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(r["paths"].items()))
        lines.append(f"| {r['L']} | {r['label']} | {r['ms_per_token']:.1f} | {share} | {ratio} | {mix} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: FsPath) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in dict.fromkeys(r["label"] for r in rows):
        pts = [(r["L"], r["ms_per_token"]) for r in rows if r["label"] == label]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms per generated token")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
