"""The prefix cache's two workloads, with and without the cache, in one process (issue 30).

1. A long document asked a second question: the prompt is the document (``--doc-tokens`` tokens of the
   corpus) followed by a question; the first question's request prefills the document, the second's
   reuses its cached blocks. Time to first token (the engine's: arrival to the first token) of both,
   with the cache and without; each round uses a fresh ``cache_salt`` so that its first question is cold.
2. ``--streams`` streams that share a system prompt (``--system-tokens`` tokens), each with its own
   question, submitted together: generated tokens per second from the first submission to the last
   token, with the cache and without.

Each setting runs on its own runner (``prefix_cache`` on / off: the server's ``--prefix-cache``) over
the same weights, through the real engine (admission, chunked prefill within --max-step-tokens, batched
decode), greedy; the settings take turns round by round. The document and the system prompt are spans of the corpus
(default: the King James Bible of Debian's bible-kjv, as bench/eval uses).

    python -m bench.prefix_cache --threads 1
    python -m bench.prefix_cache --threads 1 --methods default full exact_topk --workloads document --cache-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.models import DEFAULT_MODEL


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint path")
    p.add_argument("--corpus", default=None, help="a UTF-8 text file (default: the King James Bible)")
    p.add_argument("--doc-tokens", type=int, default=4096, help="tokens of the document of workload 1")
    p.add_argument("--rounds", type=int, default=3, help="rounds of workload 1 (first and second question each)")
    p.add_argument("--system-tokens", type=int, default=2048, help="tokens of the shared system prompt")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams of workload 2")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens each stream of workload 2 generates")
    p.add_argument("--prefill-chunk", type=int, default=None, help="the server's --prefill-chunk (default: its own)")
    p.add_argument("--methods", nargs="+", default=["default"],
                   help='attention methods, "name[:key=value,...]" or "default" (the server\'s); they take turns')
    p.add_argument("--workloads", nargs="+", choices=("document", "streams"), default=["document", "streams"],
                   help="which workloads to run (default: both)")
    p.add_argument("--cache-only", action="store_true", help="only the runners with the cache (no baseline without)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json")
    return p.parse_args(argv)


async def _request(engine, **fields):
    """Submit one request and read its stream -> the final event (usage, timings)."""
    from retopk_server.engine import RequestStream
    from retopk_server.engine.requests import GenerationRequest

    stream = RequestStream()
    engine.submit(GenerationRequest(**fields), stream)
    final = None
    async for event in stream:
        if event.finish_reason is not None:
            final = event
    return final


def _greedy():
    from retopk_server.runtime import SamplingParams

    return SamplingParams(temperature=0.0)


def document_questions(engine, doc: list[int], rounds: int, encode, first_round: int = 0) -> list[dict]:
    """Workload 1 on ``engine``: per round, TTFT of the first and of the second question (each round under a
    salt of its own: its first question finds nothing cached)."""
    questions = ("\n\nQuestion: Who is named first in this text, and what did he do?\nAnswer:",
                 "\n\nQuestion: Summarise the last paragraph in one sentence.\nAnswer:")
    rows = []
    for r in range(first_round, first_round + rounds):
        ttft, cached = [], []
        for i, q in enumerate(questions):
            final = asyncio.run(_request(engine, request_id=f"doc{r}-{i}", token_ids=doc + encode(q),
                                         max_new_tokens=1, sampling=_greedy(), cache_salt=f"round {r}"))
            ttft.append(final.timings.time_to_first_token_s)
            cached.append(final.usage.cached_tokens)
        rows.append({"first_s": ttft[0], "second_s": ttft[1], "second_cached": cached[1],
                     "prompt_tokens": len(doc) + len(encode(questions[1]))})
    return rows


def shared_system_prompt(engine, system: list[int], streams: int, max_new: int, encode, salt: str) -> dict:
    """Workload 2 on ``engine``: ``streams`` requests at once -> generated tokens/s and the TTFTs."""

    async def run():
        tasks = [_request(engine, request_id=f"s{i}", token_ids=system + encode(f"\n\nUser {i}: Tell me about "
                                                                               f"verse {i + 1}.\nAssistant:"),
                          max_new_tokens=max_new, ignore_eos=True, sampling=_greedy(), cache_salt=salt)
                 for i in range(streams)]
        return await asyncio.gather(*tasks)

    t0 = time.perf_counter()
    finals = asyncio.run(run())
    wall = time.perf_counter() - t0
    generated = sum(f.usage.generated_tokens for f in finals)
    return {"wall_s": wall, "generated": generated, "tokens_per_s": generated / wall,
            "cached_tokens": sum(f.usage.cached_tokens for f in finals),
            "ttft_median_s": statistics.median(f.timings.time_to_first_token_s for f in finals)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    enable_transparent_hugepages()  # before torch is imported: see retopk_core/hugepages.py
    import torch

    from bench.e2e_cpu import parse_method
    from bench.eval.common import load_corpus, split_documents
    from retopk_server.engine import Engine
    from retopk_server.engine.requests import EngineConfig
    from retopk_server.runtime import ModelRunner, RuntimeConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
    text = load_corpus(args.corpus)
    settings = (("with", True),) if args.cache_only else (("without", False), ("with", True))
    results: dict = {"threads": torch.get_num_threads(), "methods": {}}
    engines = {}  # (method, setting) -> Engine
    for name in args.methods:
        results["methods"][name] = {key: {"document": []} for key, _ in settings}
        for key, cache in settings:
            runner = ModelRunner(RuntimeConfig(model=args.model, prefix_cache=cache, default_method=parse_method(name),
                                               **chunk))
            engines[name, key] = Engine(lambda runner=runner: runner, EngineConfig(max_running=max(16, args.streams)))
            results["grid"] = runner.prefill_grid

    def encode(s: str, runner=runner) -> list[int]:  # any runner: the same tokenizer
        return runner.encode(s, add_special_tokens=False)

    doc, system = split_documents(text, encode, 2, max(args.doc_tokens, args.system_tokens))
    doc, system = doc[:args.doc_tokens], system[:args.system_tokens]
    for engine in engines.values():
        engine.start()
    try:
        # the methods and settings take turns round by round, so that a change in the machine's load hits all alike
        for r in range(args.rounds if "document" in args.workloads else 0):
            for (name, key), engine in engines.items():
                results["methods"][name][key]["document"] += document_questions(engine, doc, 1, encode, first_round=r)
        for (name, key), engine in engines.items():
            if "streams" in args.workloads:
                results["methods"][name][key]["streams"] = shared_system_prompt(
                    engine, system, args.streams, args.max_new_tokens, encode, salt=key)
    finally:
        for engine in engines.values():
            engine.stop()
    for name, per in results["methods"].items():
        report(name, per, results, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return results


def report(method: str, per: dict, results: dict, args) -> None:
    print(f"# prefix_cache: {args.model}, method {method}, {results['threads']} threads, prefill grid "
          f"{results['grid']} tokens, median of {args.rounds} rounds")
    if "document" in args.workloads:
        med = {k: {f: statistics.median(r[f] for r in v["document"]) for f in ("first_s", "second_s")}
               for k, v in per.items()}
        prompt, cached = per["with"]["document"][0]["prompt_tokens"], per["with"]["document"][0]["second_cached"]
        print(f"\n## A {args.doc_tokens}-token document asked a second question ({prompt} prompt tokens, "
              f"{cached} of them cached)\n")
        print("| | first question TTFT | second question TTFT | second / first |\n|---|---|---|---|")
        for k, m in med.items():
            print(f"| {k} the cache | {m['first_s']:.2f} s | {m['second_s']:.2f} s | "
                  f"{m['second_s'] / m['first_s']:.1%} |")
        ratios = ", ".join(f"{r['second_s'] / r['first_s']:.1%}" for r in per["with"]["document"])
        print(f"\nsecond / first with the cache, round by round: {ratios}")
        if "without" in med:
            share = med["with"]["second_s"] / med["without"]["second_s"]
            print(f"second question with / without the cache: {share:.1%}")
    if "streams" in args.workloads:
        print(f"\n## {args.streams} streams sharing a {args.system_tokens}-token system prompt, {args.max_new_tokens} "
              "new tokens each\n")
        print("| | wall | generated tokens/s | median TTFT | prompt tokens from the cache |\n|---|---|---|---|---|")
        for k, v in per.items():
            v = v["streams"]
            print(f"| {k} the cache | {v['wall_s']:.1f} s | {v['tokens_per_s']:.2f} | {v['ttft_median_s']:.2f} s | "
                  f"{v['cached_tokens']} |")
        if "without" in per:
            speedup = per["with"]["streams"]["tokens_per_s"] / per["without"]["streams"]["tokens_per_s"]
            print(f"\nthroughput with / without the cache: {speedup:.2f}x")


if __name__ == "__main__":
    main()
