"""The newcomers' prefill wave (issue 28): what a wave of new requests costs the engine before their first tokens.

Per wave, as the engine's admission does for N requests that arrive together: N sessions opened and their prompts
started (``open_session`` + ``start_prefill``: KV blocks, the method's state slots reset), all N prompts fed in ONE
shared forward (``runner.prefill_together``), then the sessions closed. The prompts are N different chat requests
of about 48 tokens (``PROMPTS``, cycled past eight). Each part is timed on the thread's CPU clock
(``time.thread_time``, what a loaded machine's other work inflates least), on one torch thread, with the server's
default method and weights. With several ``--activations`` each gets its own runner and they take turns, round by
round. Prints per activations the median ms of each part and of the whole wave over all timed waves.

    python -m bench.prefill_wave --prompts 8 --waves 4 --rounds 3 --activations float32 bf16x2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from retopk_server.runtime import ModelRunner, RuntimeConfig
from retopk_server.runtime.runtime_config import ACTIVATIONS

PARTS = ("open", "forward", "close", "wave")
PROMPTS = ("Write a short story about a lighthouse keeper who finds a message in a bottle one stormy night.",
           "Explain how photosynthesis works in plants, and why leaves change colour in the autumn season.",
           "List three reasons why the Roman Empire fell, with one sentence about each of those reasons.",
           "What is the difference between a list and a tuple in Python? Give a small example of each.",
           "Describe the water cycle for a ten year old child, using simple words and a friendly tone.",
           "Summarise the plot of Hamlet in five sentences, naming the main characters as they appear.",
           "How do I bake a loaf of sourdough bread at home? Give the steps in order, briefly please.",
           "Translate the sentence 'the cat sleeps on the warm windowsill' into French and Spanish.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="requests in the wave, N")
    p.add_argument("--waves", type=int, default=4, help="timed waves per round and activations")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--activations", nargs="+", default=["float32"], choices=ACTIVATIONS,
                   help="the block products' activations (RuntimeConfig.activations; bf16x2 needs AMX), in turns")
    return p.parse_args(argv)


def wave(runner: ModelRunner, prompts: list[list[int]]) -> dict[str, float]:
    """One wave -> thread CPU seconds of each part."""
    t0 = time.thread_time()
    sessions = [runner.open_session() for _ in prompts]
    jobs = [runner.start_prefill(s, ids) for s, ids in zip(sessions, prompts, strict=True)]
    t1 = time.thread_time()
    out = runner.prefill_together([(job, job.remaining) for job in jobs])
    t2 = time.thread_time()
    for s in sessions:
        runner.close_session(s)
    t3 = time.thread_time()
    if not all(isinstance(logits, torch.Tensor) for logits in out):
        raise RuntimeError(f"a prompt of the wave did not finish: {out}")
    return {"open": t1 - t0, "forward": t2 - t1, "close": t3 - t2, "wave": t3 - t0}


def main(argv=None) -> dict[str, dict[str, float]]:
    args = parse_args(argv)
    torch.set_num_threads(1)
    runners = {act: ModelRunner(RuntimeConfig(activations=act)) for act in args.activations}
    first = next(iter(runners.values()))
    prompts = [first.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
               for i in range(args.prompts)]
    tokens = sum(len(ids) for ids in prompts)
    print(f"# prefill_wave: {args.prompts} prompts, {tokens} tokens in one forward, weights "
          f"{first.decoder.matmul_format}, default method, one thread (thread CPU time)")
    times = {act: {part: [] for part in PARTS} for act in runners}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for act, runner in runners.items():
                wave(runner, prompts)  # the pools and the allocator's pages as a server's next wave finds them
                for _ in range(args.waves):
                    for part, seconds in wave(runner, prompts).items():
                        times[act][part].append(seconds)
    med = {act: {part: 1e3 * statistics.median(t) for part, t in parts.items()} for act, parts in times.items()}
    print(f"{'activations':>12} " + " ".join(f"{part + ' ms':>10}" for part in PARTS) + f" {'us/token':>9}")
    for act, parts in med.items():
        print(f"{act:>12} " + " ".join(f"{parts[part]:>10.1f}" for part in PARTS)
              + f" {1e3 * parts['forward'] / tokens:>9.1f}")
    return med


if __name__ == "__main__":
    main()
