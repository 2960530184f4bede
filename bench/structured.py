"""What constrained decoding and n > 1 cost, on the runner (issue 29's targets; a benchmark, not a test).

1. Per decode step at batch B (default 1 and 8): every row sampling under a JSON schema (its mask filled
   on the helper thread while the forward runs, as the engine does) against every row unconstrained, in
   the same process, alternating, with the ratio (target: <= 1.10).
2. n choices of one prompt: one prefill and ``runner.fork`` against n prefills, and one decode step of the
   n forks against one of n separately prefilled rows (the target: about equal) and of a single row.

    python bench/structured.py --batches 1 8 --steps 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from retopk_core.models import DEFAULT_MODEL
from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig
from retopk_server.runtime.constraints import ConstraintCompiler, ConstraintSpec, RowConstraint
from retopk_server.runtime.sampling import Sampler, SamplingParams

# strings that may go on (no maxLength, no maxItems): the grammar stays open for as many steps as asked
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--method", default=None, help="attention method (default: the server's default)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs of each kind")
    p.add_argument("--n", type=int, default=4, help="choices of part 2")
    p.add_argument("--prompt", default="Write notes about a trip to the mountains, as JSON.")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object too")
    return p.parse_args(argv)


def step_time(runner: ModelRunner, compiled, prompt: list[int], batch: int, steps: int) -> float:
    """Median seconds of one decode step + sampling of ``batch`` rows (constrained when ``compiled``)."""
    sessions = [runner.open_session() for _ in range(batch)]
    try:
        logits = torch.stack([runner.prefill(s, prompt) for s in sessions])
        rows = [None] * batch
        samplers = []
        for i in range(batch):
            rows[i] = RowConstraint.of(compiled, runner.info.vocab_size) if compiled is not None else None
            samplers.append(Sampler(SamplingParams(temperature=0.0), constraint=rows[i]))
        generated: list[list[int]] = [[] for _ in range(batch)]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            tokens = []
            for i, sampler in enumerate(samplers):
                if rows[i] is not None and rows[i].terminated:  # a closed value: start a new one (counted)
                    rows[i] = sampler.constraint = RowConstraint.of(compiled, runner.info.vocab_size)
                tokens.append(sampler.sample(logits[i], generated[i], prompt))
                generated[i].append(tokens[-1])
            for row in rows:
                if row is not None and not row.terminated:
                    row.start_fill()
            logits, _ = runner.decode(sessions, tokens)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        for s in sessions:
            runner.close_session(s)


def fork_times(runner: ModelRunner, prompt: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    source = runner.open_session()
    runner.prefill(source, prompt)
    forks = runner.fork(source, n - 1)
    one_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    separate = [runner.open_session() for _ in range(n)]
    for s in separate:
        runner.prefill(s, prompt)
    n_prefills = time.perf_counter() - t0
    rows = [source, *forks]
    single, batched, separate_batch = [], [], []
    for _ in range(8):  # alternating: one row, the n forks, n separate prefills as one batch
        t0 = time.perf_counter()
        runner.decode([separate[0]], [1])
        single.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        runner.decode(rows, [1] * n)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        runner.decode(separate, [1] * n)
        separate_batch.append(time.perf_counter() - t0)
    for s in rows + separate:
        runner.close_session(s)
    return {"prefill_and_fork_s": one_prefill, "n_prefills_s": n_prefills,
            "step_1_row_s": statistics.median(single), f"step_{n}_forks_s": statistics.median(batched),
            f"step_{n}_separate_s": statistics.median(separate_batch)}


def main(argv=None) -> int:
    args = parse_args(argv)
    method = MethodSpec(args.method) if args.method else None
    config = RuntimeConfig(model=args.model, **({"default_method": method} if method else {}))
    runner = ModelRunner(config)
    compiler = ConstraintCompiler(runner.tokenizer, runner.info.vocab_size, runner.info.eos_token_ids)
    compiled = compiler.compile(ConstraintSpec("json_schema", json.dumps(SCHEMA)))
    prompt = runner.encode_chat([{"role": "user", "content": args.prompt}])
    results: dict = {"model": args.model, "steps": args.steps, "batches": {}}
    print(f"{'batch':>5} {'plain ms/step':>14} {'json ms/step':>13} {'ratio':>6}")
    with torch.inference_mode():
        for batch in args.batches:
            plain, constrained = [], []
            for _ in range(args.repeats):  # alternating, so that load drifts hit both alike
                plain.append(step_time(runner, None, prompt, batch, args.steps))
                constrained.append(step_time(runner, compiled, prompt, batch, args.steps))
            p, c = statistics.median(plain), statistics.median(constrained)
            results["batches"][batch] = {"plain_s": p, "json_schema_s": c, "ratio": c / p}
            print(f"{batch:>5} {p * 1e3:>14.2f} {c * 1e3:>13.2f} {c / p:>6.3f}")
        forks = fork_times(runner, prompt, args.n)
    results["n"] = {"n": args.n, **forks}
    print(f"n = {args.n}: prefill + fork {forks['prefill_and_fork_s'] * 1e3:.1f} ms vs {args.n} prefills "
          f"{forks['n_prefills_s'] * 1e3:.1f} ms; a step of the {args.n} forks "
          f"{forks[f'step_{args.n}_forks_s'] * 1e3:.1f} ms vs {args.n} separate rows "
          f"{forks[f'step_{args.n}_separate_s'] * 1e3:.1f} ms and one row {forks['step_1_row_s'] * 1e3:.1f} ms")
    if args.json:
        print(json.dumps(results))
    compiler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
