"""The newcomers' prefill wave (issue 28): what a wave of new requests costs the engine before their first tokens.

Per wave, as the engine's admission does for N requests that arrive together: N sessions opened and their prompts
started (``open_session`` + ``start_prefill``: KV blocks, the method's state slots reset), all N prompts fed in ONE
shared forward (``runner.prefill_together``), then the sessions closed. The prompts are N different chat requests
of about 48 tokens (``PROMPTS``, cycled past eight). Each part is timed on the thread's CPU clock
(``time.thread_time``, what a loaded machine's other work inflates least), on one torch thread, with the server's
default method and weights. With several ``--activations`` each gets its own runner and they take turns, round by
round; "auto" (the default) is what the server runs by default (bf16x2 with AMX, int16 with AVX-512 VNNI, where
the decoder takes it, else float32: Decoder.auto_activations), its rows labelled with what it resolved to. Prints
per activations the median ms of each part and of the whole wave over all timed waves.

    python -m bench.prefill_wave --prompts 8 --waves 4 --rounds 3 --activations float32 bf16x2

With ``--threads N`` (torch's threads, as a server's ``--threads``) it also prints, per activations, the median
wall ms of the forward and of the wave and the CPU ms of all the process's threads ("all", ``time.process_time``)
beside the calling thread's ("main"), and "alone" = 2 main - all: with ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP
threads sleep, so "all" is the team's work) and two threads, the calling thread's work the other thread did not
share (the serial part), which a loaded machine's other work inflates less than wall time (bench/step_parts.py's
columns).

    OMP_WAIT_POLICY=PASSIVE python -m bench.prefill_wave --threads 2 --waves 4 --rounds 3 --activations bf16x2

``--split-rows on off`` takes turns, wave by wave within each round, between the packed products split by rows over
the threads where linear.py's ``split_rows`` says so (on, the runtime's rule) and never split (off: one oneDNN call
each), in one process, so a loaded machine's drift hits both alike; rows are labelled "ACTIVATIONS/on" and "/off".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from retopk_server.runtime import ModelRunner, RuntimeConfig
from retopk_server.runtime.decoder import linear
from retopk_server.runtime.runtime_config import ACTIVATION_CHOICES

PARTS = ("open", "forward", "close", "wave")
WHOLE = ("forward", "wave")  # the parts whose wall and all-thread CPU time the --threads table shows
CLOCKS = {"main": time.thread_time, "all": time.process_time, "wall": time.perf_counter}
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
    p.add_argument("--waves", type=int, default=4, help="timed waves per round, activations and split")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--activations", nargs="+", default=["auto"], choices=ACTIVATION_CHOICES,
                   help="the block products' activations (RuntimeConfig.activations; bf16x2 needs AMX), in turns; "
                        "auto (the default): as the server's default resolves it")
    p.add_argument("--split-rows", nargs="+", default=["on"], choices=("on", "off"),
                   help="the packed products' split by rows (linear.split_rows) as the runtime has it, or never; "
                        "in turns")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's threads; above 1, also the forward's and the wave's wall and all-thread CPU time")
    return p.parse_args(argv)


def wave(runner: ModelRunner, prompts: list[list[int]]) -> dict[str, dict[str, float]]:
    """One wave -> per clock of CLOCKS (the calling thread's CPU, all threads' CPU, wall), seconds of each part."""
    def now() -> dict[str, float]:
        return {name: clock() for name, clock in CLOCKS.items()}

    t0 = now()
    sessions = [runner.open_session() for _ in prompts]
    jobs = [runner.start_prefill(s, ids) for s, ids in zip(sessions, prompts, strict=True)]
    t1 = now()
    out = runner.prefill_together([(job, job.remaining) for job in jobs])
    t2 = now()
    for s in sessions:
        runner.close_session(s)
    t3 = now()
    if not all(isinstance(logits, torch.Tensor) for logits in out):
        raise RuntimeError(f"a prompt of the wave did not finish: {out}")
    return {c: {"open": t1[c] - t0[c], "forward": t2[c] - t1[c], "close": t3[c] - t2[c], "wave": t3[c] - t0[c]}
            for c in CLOCKS}


def main(argv=None) -> dict[str, dict[str, float]]:
    """Per activations, the median ms of each part of PARTS (the calling thread's CPU), and with --threads above one
    also of WHOLE's parts per clock and "alone" (2 main - all), keyed "forward wall", "wave all", ..."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runners = {}
    for act in args.activations:  # keyed by what each runner resolved (auto: the server's default), once each
        runner = ModelRunner(RuntimeConfig(activations=act))
        runners.setdefault(runner.decoder.activations, runner)
    first = next(iter(runners.values()))
    prompts = [first.encode_chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
               for i in range(args.prompts)]
    tokens = sum(len(ids) for ids in prompts)
    print(f"# prefill_wave: {args.prompts} prompts, {tokens} tokens in one forward, weights "
          f"{first.decoder.matmul_format}, default method, {torch.get_num_threads()} thread(s) (the calling thread's "
          f"CPU time)")
    labels = {(act, split): act if len(args.split_rows) == 1 else f"{act}/{split}"
              for act in runners for split in args.split_rows}
    times = {label: {f"{part} {c}": [] for c in CLOCKS for part in PARTS} for label in labels.values()}
    rule = linear.SPLIT_ROWS
    with torch.inference_mode():
        for _ in range(args.rounds):
            for act, runner in runners.items():
                wave(runner, prompts)  # the pools and the allocator's pages as a server's next wave finds them
                for _ in range(args.waves):
                    for split in args.split_rows:
                        linear.SPLIT_ROWS = rule if split == "on" else 1 << 62  # off: no product has the rows
                        for c, parts in wave(runner, prompts).items():
                            for part, seconds in parts.items():
                                times[labels[act, split]][f"{part} {c}"].append(seconds)
    linear.SPLIT_ROWS = rule
    for t in times.values():
        for part in WHOLE:
            t[f"{part} alone"] = [2 * m - a for m, a in zip(t[f"{part} main"], t[f"{part} all"], strict=True)]
    keys = [f"{part} {c}" for part in WHOLE for c in ("wall", "main", "all", "alone")] if args.threads > 1 else []
    med = {act: {part: 1e3 * statistics.median(t[f"{part} main"]) for part in PARTS}
           | {key: 1e3 * statistics.median(t[key]) for key in keys} for act, t in times.items()}
    print(f"{'activations':>12} " + " ".join(f"{part + ' ms':>10}" for part in PARTS) + f" {'us/token':>9}")
    for act, parts in med.items():
        print(f"{act:>12} " + " ".join(f"{parts[part]:>10.1f}" for part in PARTS)
              + f" {1e3 * parts['forward'] / tokens:>9.1f}")
    if keys:
        print(f"{'activations':>12} " + " ".join(f"{key:>12}" for key in keys) + "   (ms; all: every thread's CPU)")
        for act, parts in med.items():
            print(f"{act:>12} " + " ".join(f"{parts[key]:>12.1f}" for key in keys))
    return med


if __name__ == "__main__":
    main()
