"""End-to-end decode speed: ms per generated token with a real model at growing contexts.

For each context length L the same prompt (the first L tokens of a text) is prefilled for every
method (its dense prefix computed once and copied into each method's session, the last tokens
prefilled by each method itself), then the methods take turns decoding N tokens each, greedily
through the runtime, for a few rounds (the machine's speed drifts; turns spread the drift over
every method). Reported are
ms/token, the share of it spent in the attention core (from the runtime's per-step stats), the path
mix, for ReTopK the share of layer-steps with an exact pass (some head of the layer read its KV
group's keys in full), for every method the group-read rate (the share of (layer, KV group, step)
triples whose keys were read in full: under GQA, what a step costs), and transformers' own
``generate`` on the same model and prompt as the outside baseline (N tokens decoded from a
copy of the prompt's prefilled cache, so no prefill is timed). All in one process. Each length's table
is printed (and <out>.json rewritten) as soon as it is measured.

    python -m bench.e2e_cpu --lengths 1024 2048 4096 8000 --new-tokens 16 --rounds 3
    python -m bench.e2e_cpu --lengths 16384 32000 --rope-scaling linear:4 --threads 2   # past the 8K positions
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.models import DEFAULT_MODEL

enable_transparent_hugepages()  # before torch allocates anything: see retopk_core/hugepages.py

import torch

from bench.eval.common import load_corpus, prefill_all, progress_bar
from retopk_server.cli import parse_params, parse_rope_scaling
from retopk_server.config import ServerConfig
from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig
from retopk_server.runtime.runtime_config import KV_DTYPES, WEIGHTS

DEFAULT_METHODS = ["full", "exact_topk:top_k=64", "retopk:top_k=64", "default"]


def parse_method(text: str) -> MethodSpec:
    """"name" or "name:key=value,key=value" -> MethodSpec (values parsed as the server's CLI does);
    "default" is the method a server started without --method uses."""
    if text == "default":
        return ServerConfig().method_spec()
    name, _, rest = text.partition(":")
    return MethodSpec.of(name, **parse_params(rest))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint path")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    p.add_argument("--new-tokens", type=int, default=16, help="decoded tokens timed per method, length and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds in which the methods take turns")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                   help='method specs "name[:key=value,...]" (default: %(default)s)')
    p.add_argument("--corpus", default="kjv", help="prompt text file, or 'kjv' for the King James Bible (default)")
    p.add_argument("--no-generate", action="store_true", help="skip transformers' generate baseline (always "
                   "skipped with --rope-scaling)")
    p.add_argument("--weights", default="auto", choices=WEIGHTS, help="matmul weight format (RuntimeConfig.weights)")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="KV cache dtype (RuntimeConfig.kv_dtype)")
    p.add_argument("--rope-scaling", type=parse_rope_scaling, default=None,
                   help='extend the context by RoPE scaling, e.g. "linear:4" (lengths past the trained positions)')
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json and <out>.png")
    return p.parse_args(argv)


class TimedSession:
    """One method's session on one prompt: prefilled once, then decoded greedily a few tokens at a
    time (``decode``), so that methods can take turns. Accumulates per-token wall time, the attention
    core's share, the path mix over heads, the layer-steps in which some KV group was read in full
    (some head took an exact path: ReTopK's fallback, refresh or promoted), and the (layer, KV group,
    step) triples read in full (the step stats' ``group_read``)."""

    def __init__(self, runner: ModelRunner, spec: MethodSpec, session, logits: torch.Tensor) -> None:
        """``session``: prefilled with the prompt, ``logits`` (V,) after its last token."""
        self.runner, self.spec, self.session = runner, spec, session
        self.tok = int(logits.argmax())
        self.decode(1, timed=False)  # warm-up step
        self.steps, self.total, self.attn, self.exact_layers, self.group_reads = 0, 0.0, 0.0, 0, 0
        self.paths: dict[str, int] = {}

    def decode(self, n: int, timed: bool = True) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            logits, stats = self.runner.decode([self.session], [self.tok], with_stats=True)
            elapsed = time.perf_counter() - t0
            self.tok = int(logits[0].argmax())
            if not timed:
                continue
            self.steps += 1
            self.total += elapsed
            self.attn += stats[0].attention_s
            for k, v in stats[0].counts().items():
                self.paths[k] = self.paths.get(k, 0) + v
            read = stats[0].group_read  # (layers, H_kv) bool
            self.exact_layers += int(read.any(-1).sum())
            self.group_reads += int(read.sum())

    def close(self) -> None:
        self.runner.close_session(self.session)

    def result(self) -> dict:
        """layer_steps_with_exact: share of (layer, step) pairs with an exact pass (ReTopK only, else None);
        group_read_rate: share of (layer, KV group, step) triples whose keys were read in full."""
        layer_steps = self.steps * self.runner.info.num_layers
        return {"ms_per_token": 1e3 * self.total / self.steps, "attention_share": self.attn / self.total,
                "paths": self.paths, "tokens": self.steps,
                "layer_steps_with_exact": self.exact_layers / layer_steps if self.spec.name == "retopk" else None,
                "group_read_rate": self.group_reads / (layer_steps * self.runner.info.num_kv_heads)}


def time_generate(model, prompt: list[int], n: int) -> float:
    """transformers' generate, greedy, ms per token: the prompt but its last token is prefilled once into
    a DynamicCache, and each timed call decodes n tokens from a deep copy of it (generate feeds only the
    uncached last token). Subtracting a 1-token run instead leaves two prefills' noise in the difference
    (at 4K it once came out negative)."""
    import copy

    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    cache = DynamicCache(config=model.config)
    model(ids[:, :-1], past_key_values=cache, use_cache=True)

    def run(k: int) -> float:
        past = copy.deepcopy(cache)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, past_key_values=past, max_new_tokens=k, min_new_tokens=k,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    run(1)  # warm-up
    return 1e3 * run(n) / n


def tokens_needed(length: int, n: int, rounds: int) -> int:
    """Positions one session uses at context ``length``: the prompt, the warm-up step, rounds x n steps."""
    return length + 1 + rounds * n


def run(runner: ModelRunner, specs: list[MethodSpec], ids: list[int], lengths: list[int], n: int,
        generate_model=None, rounds: int = 1, progress=None, on_length=None) -> list[dict]:
    """Every method (and transformers' generate) at every length on the prompt ids[:L].

    The prompt's dense prefix is computed once per length and copied into every method's session
    (``bench.eval.common.prefill_all``; each method prefills the prompt's last tokens itself, so its
    prefill hook sees them as after a plain prefill). The methods take turns, n tokens each per round,
    for ``rounds`` rounds: the machine's speed drifts over minutes, and turns spread that drift over
    every method alike. ``generate_model``: a transformers model of the same weights whose own ``generate``
    is timed too (a slower outside baseline; None: not timed). ``progress`` (a tqdm bar or None) advances
    once per method and round; ``on_length(rows)`` is called with the rows so far after each length.
    """
    rows = []
    with_generate = generate_model is not None
    for L in lengths:
        prompt = ids[:L]
        opened = [runner.open_session(spec) for spec in specs]
        try:
            logits = prefill_all(runner, opened, prompt)  # (methods, V)
        except BaseException:
            for s in opened:
                runner.close_session(s)
            raise
        sessions = [TimedSession(runner, spec, s, lg) for spec, s, lg in zip(specs, opened, logits, strict=True)]
        generate_ms = []
        try:
            for _ in range(rounds):
                for s in sessions:
                    s.decode(n)
                    if progress is not None:
                        progress.update(1)
                if with_generate:
                    with torch.inference_mode():
                        generate_ms.append(time_generate(generate_model, prompt, n))
                    if progress is not None:
                        progress.update(1)
        finally:
            for s in sessions:
                s.close()
        rows += [{"L": L, "method": s.spec.describe(), "label": _label(s.spec), **s.result()} for s in sessions]
        if with_generate:
            rows.append({"L": L, "method": {"method": "transformers.generate"}, "label": "transformers generate",
                         "ms_per_token": sum(generate_ms) / rounds, "attention_share": None, "paths": {},
                         "tokens": n * rounds, "group_read_rate": None})
        exact = [r for r in rows if r["L"] == L and r["method"]["method"] == "exact_topk"]
        for r in rows:
            if r["L"] == L:
                r["speedup_vs_exact"] = exact[0]["ms_per_token"] / r["ms_per_token"] if exact else None
        if on_length is not None:
            on_length(rows)
    return rows


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [parse_method(m) for m in args.methods]
    runner = ModelRunner(RuntimeConfig(model=args.model, default_method=specs[0], rope_scaling=args.rope_scaling,
                                       weights=args.weights, kv_dtype=args.kv_dtype))
    ids = runner.encode(load_corpus(args.corpus)[:8 * max(args.lengths)], add_special_tokens=False)  # ~4 chars a token
    if len(ids) < max(args.lengths):
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than the longest length {max(args.lengths)}")
    need = tokens_needed(max(args.lengths), args.new_tokens, args.rounds)
    if need > runner.max_context:  # refuse before hours of prefill, not at the first decode step
        raise SystemExit(f"--lengths {max(args.lengths)} needs {need} positions with --new-tokens {args.new_tokens} "
                         f"x --rounds {args.rounds} + 1, more than the model's max_context {runner.max_context} "
                         f"(rope scaling {args.rope_scaling}); use a length <= "
                         f"{runner.max_context - tokens_needed(0, args.new_tokens, args.rounds)}")
    print(f"# e2e_cpu: {args.model}, {runner.info.num_layers} layers, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds of {args.new_tokens} tokens per point, rope scaling {args.rope_scaling}", flush=True)
    def save(rows: list[dict]) -> None:  # after every length, so a stopped run keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1, default=str))

    def report(rows: list[dict]) -> None:
        bar.write(table([r for r in rows if r["L"] == rows[-1]["L"]]))
        save(rows)

    generate_model = None
    if not (args.no_generate or args.rope_scaling):
        from retopk_core.models import load_model

        generate_model = load_model(args.model)[0]  # float32, transformers' own modules
    bar = progress_bar(len(args.lengths) * args.rounds * (len(specs) + (generate_model is not None)), "e2e_cpu")
    with bar:
        rows = run(runner, specs, ids, args.lengths, args.new_tokens, generate_model, args.rounds, bar,
                   on_length=report)
    print(table(rows))
    save(rows)
    if args.out:
        plot(rows, args.out.with_suffix(".png"))
    return rows


def _label(spec: MethodSpec) -> str:
    params = ",".join(f"{k}={v}" for k, v in spec.params)
    return spec.name + (f"({params})" if params else "")


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.0f}%"


def table(rows: list[dict]) -> str:
    """Markdown table. "layer-steps with an exact pass": ReTopK's (layer, step) pairs in which some KV group
    was read in full; "KV groups read": the group-read rate, over (layer, KV group, step) triples."""
    lines = ["| L | method | ms/token | attention share | vs Exact Top-K | paths | layer-steps with an exact pass "
             "| KV groups read (of layer x group x step) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "" if r.get("speedup_vs_exact") is None else f"{r['speedup_vs_exact']:.2f}x"
        total = sum(r["paths"].values()) or 1
        mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(r["paths"].items()))
        lines.append(f"| {r['L']} | {r['label']} | {r['ms_per_token']:.1f} | {_percent(r['attention_share'])} "
                     f"| {ratio} | {mix} | {_percent(r.get('layer_steps_with_exact'))} "
                     f"| {_percent(r.get('group_read_rate'))} |")
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
