"""One decode step's time through the runner, after a prompt of L tokens: the quick A/B of a change to the step.

Prefills the first L tokens of a text for each method, then times ``--steps`` greedy decode steps (each step's
argmax included) after a few warm-up steps, and prints the median and the minimum per method. To compare two
commits, run it in a worktree of each, taking turns (the machine's speed drifts), e.g.

    python -m bench.decode_step --length 1024 --methods full default --threads 2

``--compare-layer-loop`` times each method's step both ways in one process, in ``--rounds`` that take turns:
the layers in one call of the fused CPU library (the runner's default where the step allows it,
runtime/whole_step.py) and layer by layer in Python, and prints the ratio. ``--compare-activations [A ...]`` does
the same with the block products' activations (RuntimeConfig.activations; float32 and int8 unless named, e.g.
``float32 bf16x2`` on a CPU with AMX; ``auto`` as the server resolves it), each against the first, on the step
thread's CPU clock with ``--threads 1`` (wall time otherwise), and ``--activations`` picks them for a plain run:
"auto" by default, what the server runs by default (bf16x2 with AMX, int16 with AVX-512 VNNI, where the decoder
takes it, else float32: Decoder.auto_activations), and the header's weights show what it became.

``--step-turns`` opens one session per method and decodes them one after another within every step, the order
rotating, so a loaded machine's drift hits each method alike: per method the median step, attention
(StepStats.attention_s) and CPU time of the step's thread (``time.thread_time``: the step's whole CPU time with
``--threads 1``, what a loaded machine's other work does not inflate), the per-step median ratios of the first
method's times to its, the share of keys scored (Σ n_scored / (layers · H · L_t)), the mean M_t = |A_t| of its
reuse heads, and its share of (layer, KV group) reads. The A/B of two specs of one method on a busy machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from retopk_core.hugepages import enable_transparent_hugepages

enable_transparent_hugepages()  # before torch allocates anything: see retopk_core/hugepages.py

import torch  # noqa: E402 - after the huge pages

from bench.e2e_cpu import parse_method  # noqa: E402 - after the huge pages
from bench.eval.common import load_corpus  # noqa: E402 - after the huge pages
from retopk_core.methods import Path  # noqa: E402 - after the huge pages
from retopk_server.runtime import ModelRunner, RuntimeConfig  # noqa: E402 - after the huge pages
from retopk_server.runtime.runtime_config import ACTIVATION_CHOICES, KV_DTYPES  # noqa: E402 - after the huge pages


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=1024, help="prompt tokens before the timed steps")
    p.add_argument("--methods", nargs="+", default=["full", "default"], help='method specs "name[:key=value,...]"')
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per method")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--corpus", default="kjv", help="prompt text file, or 'kjv' for the King James Bible (default)")
    p.add_argument("--compare-layer-loop", action="store_true",
                   help="time each method with its layers in one call and layer by layer, taking turns")
    p.add_argument("--compare-activations", nargs="*", choices=ACTIVATION_CHOICES, default=None, metavar="A",
                   help="time each method with these activations into the block products (none named: float32 "
                        "int8; auto: what the server's default resolves to), taking turns; ratios to the first")
    p.add_argument("--activations", default="auto", choices=ACTIVATION_CHOICES,
                   help="the block products' activations (RuntimeConfig.activations) of a plain run; auto (the "
                        "default): as the server's default resolves it")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="the KV cache's dtype (RuntimeConfig.kv_dtype); auto (the default): as the server resolves it")
    p.add_argument("--rounds", type=int, default=3, help="turns of each way with --compare-layer-loop / -activations")
    p.add_argument("--step-turns", action="store_true",
                   help="one session per method, decoded one after another within every step (ratios to the first)")
    return p.parse_args(argv)


def time_steps(runner: ModelRunner, spec, ids: list[int], warmup: int, steps: int,
               clock=time.perf_counter) -> list[float]:
    """Seconds of each timed greedy step (on ``clock``) after prefilling ``ids`` in a fresh session of ``spec``."""
    session = runner.open_session(spec)
    token = int(runner.prefill(session, ids).argmax())
    times = []
    for i in range(warmup + steps):
        start = clock()
        logits, _ = runner.decode([session], [token])
        token = int(logits[0].argmax())
        if i >= warmup:
            times.append(clock() - start)
    runner.close_session(session)
    return times


def taking_turns(runner: ModelRunner, spec, ids: list[int], args, ways: dict,
                 clock=time.perf_counter) -> dict[str, float]:
    """Median step seconds (on ``clock``) of each way (name -> a function that sets the runner up for it),
    ``args.rounds`` turns each; the first way is left set up."""
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, setup in ways.items():
            setup()
            times[name] += time_steps(runner, spec, ids, args.warmup, args.steps, clock)
    next(iter(ways.values()))()
    return {name: statistics.median(t) for name, t in times.items()}


def step_turns(runner: ModelRunner, texts: list[str], ids: list[int], warmup: int, steps: int) -> None:
    """Decode one session per method spec in ``texts``, one after another within every step (the order rotating),
    and print each method's median step, attention and thread CPU times, the per-step median ratios first / it,
    the share of keys it scored, its reuse heads' mean M_t and its reads."""
    specs = [parse_method(t) for t in texts]
    sessions = [runner.open_session(spec) for spec in specs]
    tokens = [int(runner.prefill(s, ids).argmax()) for s in sessions]
    H, H_kv = runner.info.num_heads, runner.info.num_kv_heads
    wall, attention, cpu, reads, scored, m_t = ([[] for _ in texts] for _ in range(6))
    for i in range(warmup + steps):
        L_t = len(ids) + 1 + i  # positions attended this step, its token included
        for m in [(i + j) % len(texts) for j in range(len(texts))]:
            start, cpu_start = time.perf_counter(), time.thread_time()
            logits, stats = runner.decode([sessions[m]], [tokens[m]], with_stats=True)
            took, cpu_took = time.perf_counter() - start, time.thread_time() - cpu_start
            tokens[m] = int(logits[0].argmax())
            if i >= warmup:
                wall[m].append(took)
                attention[m].append(stats[0].attention_s)
                cpu[m].append(cpu_took)
                read = (stats[0].path.view(-1, H_kv, H // H_kv) != Path.REUSE).any(-1)  # (layers, H_kv)
                reads[m].append(float(read.float().mean()))
                n = stats[0].n_scored.double()  # (layers, H)
                scored[m].append(float(n.mean()) / L_t)
                m_t[m] += n[stats[0].path == Path.REUSE].tolist()
    for s in sessions:
        runner.close_session(s)
    for m, text in enumerate(texts):
        ratio = [statistics.median(a / b for a, b in zip(t[0], t[m], strict=True)) for t in (wall, attention, cpu)]
        reuse = f"{statistics.mean(m_t[m]):.0f}" if m_t[m] else "-"
        print(f"{text}: median {1e3 * statistics.median(wall[m]):.2f} ms, attention "
              f"{1e3 * statistics.median(attention[m]):.2f} ms, CPU {1e3 * statistics.median(cpu[m]):.2f} ms; "
              f"first / this per step {ratio[0]:.3f} (attention {ratio[1]:.3f}, CPU {ratio[2]:.3f}); scored "
              f"{100 * statistics.mean(scored[m]):.1f}% of keys, reuse M_t {reuse}; group reads "
              f"{100 * statistics.mean(reads[m]):.1f}%")


def runtime_config(args) -> RuntimeConfig:
    """The runner's configuration from the command line: its activations and KV cache dtype."""
    return RuntimeConfig(activations=args.activations, kv_dtype=args.kv_dtype)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = ModelRunner(runtime_config(args))
    ids = runner.encode(load_corpus(args.corpus))[:args.length]
    print(f"# decode_step: L = {len(ids)}, {args.threads} threads, {args.steps} steps, weights "
          f"{runner.info.weight_format}, KV {runner.config.kv_torch_dtype}")
    with torch.inference_mode():
        if args.step_turns:
            step_turns(runner, args.methods, ids, args.warmup, args.steps)
            return
        for text in args.methods:
            spec = parse_method(text)
            if args.compare_layer_loop:
                t = taking_turns(runner, spec, ids, args, {
                    "one call": lambda: setattr(runner, "layers_in_one_call", True),
                    "layer by layer": lambda: setattr(runner, "layers_in_one_call", False)})
                print(f"{text}: one call median {1e3 * t['one call']:.2f} ms, layer by layer "
                      f"{1e3 * t['layer by layer']:.2f} ms, layer by layer / one call "
                      f"{t['layer by layer'] / t['one call']:.3f}x")
            elif args.compare_activations is not None:
                # one thread: the step's CPU time, which a loaded machine's other work does not inflate
                clock, kind = (time.thread_time, "thread CPU") if args.threads == 1 else (time.perf_counter, "wall")
                names = runner.decoder.resolve_activations(args.compare_activations or ["float32", "int8"])
                ways = {a: (lambda a=a: runner.decoder.set_activations(a)) for a in names}
                t = taking_turns(runner, spec, ids, args, ways, clock)
                first = names[0]
                print(f"{text}: " + ", ".join(f"{a} activations median {1e3 * t[a]:.2f} ms" for a in names)
                      + f" ({kind} time), " + ", ".join(f"{first} / {a} {t[first] / t[a]:.3f}x" for a in names[1:]))
            else:
                times = sorted(time_steps(runner, spec, ids, args.warmup, args.steps))
                print(f"{text}: median {1e3 * times[len(times) // 2]:.2f} ms, min {1e3 * times[0]:.2f} ms")


if __name__ == "__main__":
    main()
