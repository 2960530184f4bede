"""The engine thread's CPU per decode step outside the model's forward, at M streams (issue 28).

Starts an Engine around the default ModelRunner with the server's metrics observer (per-head statistics on,
no exporter), and runs ``--waves`` waves of M greedy requests (``--max-new-tokens`` each, EOS ignored) submitted
together, consumed on this thread's asyncio loop as the service consumes them. On the engine thread it times, on
that thread's CPU clock (``time.thread_time``, what a loaded machine's other work inflates least):

  step      ``EngineLoop.decode``: one batched decode step and everything the engine does with it
  forward   ``ModelRunner.forward`` inside it: the model (the layers' call, the LM head)
  runner    ``ModelRunner.decode`` less ``forward``: its checks, the step's tensors and the statistics it collects
  metrics   the observer's ``on_step`` (the Prometheus collectors' per-step update)
  greedy    ``greedy_tokens``: the batch's argmax
  deliver   ``Delivery.step_row`` of every row: push the token (stop strings, text) and send it to its stream
  outside   step less forward: the engine thread's per-step work that is not the model

Only steps over exactly M rows of waves after the first count (the first wave grows the method-state pools).
Printed: the median and the mean ms per step of each part (work done every few steps, such as the metrics' fold
of the per-head statistics, shows in the mean), and one JSON line (``--json``: the medians, and the means
under "mean"). Run it from two checkouts taking
turns (the script imports whichever ``retopk_server`` is on the path) to compare two versions of the engine:

    OMP_NUM_THREADS=1 python bench/engine_overhead.py --rows 8 --max-new-tokens 48 --waves 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from retopk_server.engine import Engine, EngineConfig, GenerationRequest, RequestStream
from retopk_server.engine import loop as engine_loop
from retopk_server.engine.delivery import Delivery
from retopk_server.metrics import MetricsObserver
from retopk_server.runtime import ModelRunner, RuntimeConfig

PARTS = ("step", "forward", "runner", "metrics", "greedy", "deliver", "outside")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="streams, M")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--waves", type=int, default=4, help="waves of M requests (the first one is not counted)")
    p.add_argument("--threads", type=int, default=1, help="torch's threads")
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a message.")
    p.add_argument("--label", default="", help="a name printed with the figures")
    p.add_argument("--json", action="store_true", help="also print the medians as one JSON line")
    return p.parse_args(argv)


class Clock:
    """Per part, the engine thread's CPU seconds of the current step; ``end`` files them when the step had M rows."""

    def __init__(self, rows: int) -> None:
        self.rows, self.current, self.steps, self.counting = rows, dict.fromkeys(PARTS, 0.0), [], False

    def wrap(self, part: str, f):
        def timed(*args, **kwargs):
            t0 = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                self.current[part] += time.thread_time() - t0
        return timed

    def begin(self) -> None:
        """A decode step starts: what the parts took since the last one (a prefill's forward) is not its."""
        self.current = dict.fromkeys(PARTS, 0.0)

    def end(self, batch: int) -> None:
        c, self.current = self.current, dict.fromkeys(PARTS, 0.0)
        if self.counting and batch == self.rows:
            c["runner"] -= c["forward"]
            c["outside"] = c["step"] - c["forward"]
            self.steps.append(c)


def instrument(engine: Engine, observer: MetricsObserver, clock: Clock) -> None:
    """Wrap the timed functions (the runner's on its instance, the engine's on their classes and module)."""
    runner = engine.runner
    runner.forward = clock.wrap("forward", runner.forward)
    runner.decode = clock.wrap("runner", runner.decode)
    observer.on_step = clock.wrap("metrics", observer.on_step)
    engine_loop.greedy_tokens = clock.wrap("greedy", engine_loop.greedy_tokens)
    Delivery.step_row = clock.wrap("deliver", Delivery.step_row)
    decode = engine_loop.EngineLoop.decode

    def step(self, batch):
        clock.begin()
        t0 = time.thread_time()
        decode(self, batch)
        clock.current["step"] += time.thread_time() - t0
        clock.end(len(batch))

    engine_loop.EngineLoop.decode = step


async def wave(engine: Engine, args, index: int) -> int:
    """M requests submitted together, each read to its end -> tokens received."""
    streams = [RequestStream() for _ in range(args.rows)]
    for i, stream in enumerate(streams):
        engine.submit(GenerationRequest(request_id=f"w{index}r{i}", chat=[{"role": "user", "content": args.prompt}],
                                        max_new_tokens=args.max_new_tokens, ignore_eos=True), stream)

    async def read(stream):
        return sum([len(event.token_ids) async for event in stream])

    return sum(await asyncio.gather(*(read(s) for s in streams)))


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    observer = MetricsObserver("bench", per_head=True)
    engine = Engine(lambda: ModelRunner(RuntimeConfig()), EngineConfig(), observer)
    engine.start()
    clock = Clock(args.rows)
    instrument(engine, observer, clock)

    async def run():
        for w in range(args.waves):
            clock.counting = w > 0
            await wave(engine, args, w)

    try:
        asyncio.run(run())
    finally:
        engine.stop()
    med = {part: 1e3 * statistics.median(s[part] for s in clock.steps) for part in PARTS}
    mean = {part: 1e3 * statistics.mean(s[part] for s in clock.steps) for part in PARTS}
    print(f"# engine_overhead {args.label}: {len(clock.steps)} steps of {args.rows} rows, {args.threads} thread(s), "
          "engine-thread CPU ms per step")
    print("median " + " ".join(f"{part} {med[part]:.3f}" for part in PARTS))
    print("mean   " + " ".join(f"{part} {mean[part]:.3f}" for part in PARTS))
    if args.json:
        print(json.dumps({"label": args.label, "rows": args.rows, "steps": len(clock.steps), **med, "mean": mean}))
    return med


if __name__ == "__main__":
    main()
