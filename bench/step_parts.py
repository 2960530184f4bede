"""Where a batched decode step's time goes: the runner's step at 1 row and at M rows (as the server runs M
streams), split into parts, so that what scales worse than M x one row's is found.

Opens M sessions of the server's default method on one chat prompt, then per timed step: ``runner.decode`` over
the first 1 or M of them (the whole step: the one-call layers, the LM head, the framework), the batch's greedy
tokens (``sampling.greedy_tokens``, as the engine takes them), and, alone on the same weights at the same rows,
each layer's ``attn_in`` (RMSNorm, QKV product, RoPE), each layer's ``mlp_out`` (o product, RMSNorm, gate-up,
SwiGLU, down) and the LM head with its norm. All on one thread's CPU clock (``time.thread_time``, what a loaded
machine's other work inflates least) but attention, which is ``StepStats.attention_s`` (wall time inside the
step); "other" is the step less the three products and attention (a loaded machine's wall time in attention can
make it small or even negative). Printed per part: the median ms at 1 row and
at M rows over ``--rounds`` rounds of ``--steps`` steps, M rows / 1 row, and M rows / (M x 1 row): 1.0 means
the batch shares nothing, lower is better.

    python -m bench.step_parts --rows 8 --steps 12 --rounds 2

With ``--threads N`` above one the products run on the team and their parts cannot be told apart on one thread's
clock: the bench then times the whole step as the server runs it. It opens M sessions, and in each of ``--rounds``
rounds, for each of the ``--activations`` named (taking turns in one process, so a loaded machine's drift hits
each alike), times ``--steps`` steps of ``runner.decode`` over the first session alone, then over all M (fresh
sessions each round). Printed per activations: the median wall ms at 1 row and at M rows and M rows / 1 row
(lower is better: M streams give M / that times one stream's tokens at the step), then per step the median CPU
ms of the calling thread ("main") and of the whole process ("all": every thread) at 1 and at M rows, and
"alone" = 2 main - all at M rows. With ``OMP_WAIT_POLICY=PASSIVE`` an idle OpenMP thread sleeps, so "all" is the
team's work and, on two threads, "alone" is about the main thread's CPU time with the other one idle (the step's
serial part; a perfectly split step has 0), a figure that a loaded machine's other work does not inflate as it
does wall time. Without it idle threads spin and "all" counts their spinning.

    python -m bench.step_parts --threads 2 --rows 8 --steps 30 --rounds 3 --activations float32 bf16x2

``--activations`` is "auto" unless named: what the server runs by default (bf16x2 with AMX, int16 with AVX-512
VNNI, where the decoder takes it, else float32: Decoder.auto_activations), shown resolved in the header and the
table's rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from retopk_core.cpu import decoder_ops
from retopk_server.runtime import ModelRunner, RuntimeConfig
from retopk_server.runtime.decoder.llama import rms_norm, rope_tables
from retopk_server.runtime.runtime_config import ACTIVATION_CHOICES
from retopk_server.runtime.sampling import Sampler, SamplingParams, greedy_tokens

PARTS = ("step", "attn_in", "mlp_out", "lm_head", "attention", "sampling", "other")
WALL = ("wall", "main", "all")  # the --threads mode's: wall seconds, the calling thread's and all threads' CPU seconds


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="the batch, M")
    p.add_argument("--steps", type=int, default=12, help="timed steps per round and batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds, each timing 1 row then M rows")
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a message.")
    p.add_argument("--activations", nargs="+", default=["auto"], choices=ACTIVATION_CHOICES,
                   help="the block products' activations (RuntimeConfig.activations; bf16x2 needs AMX), each in turn; "
                        "auto (the default): as the server's default resolves it")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's threads; above 1, the whole step's wall and CPU time instead of its parts")
    return p.parse_args(argv)


def products(runner: ModelRunner, M: int, position: int) -> dict[str, float]:
    """Thread CPU seconds of every layer's attn_in, every layer's mlp_out and the LM head at M rows."""
    dec = runner.decoder
    H, H_kv, d = dec.num_heads, dec.num_kv_heads, dec.head_dim
    x, a = torch.randn(M, dec.norm.numel()), torch.randn(M, H * d)  # (M, D), (M, H d)
    cos, sin = rope_tables(dec.rotary, x, torch.full((M, 1), position))
    t0 = time.thread_time()
    for layer in dec.layers:
        decoder_ops.attn_in(x, layer.attn_norm, dec.eps, layer.qkv.blocks, cos, sin, H + H_kv, d, dec.activations)
    t1 = time.thread_time()
    for layer in dec.layers:
        decoder_ops.mlp_out(x, a, layer.o.blocks, layer.mlp_norm, dec.eps, layer.gate_up.blocks, layer.down.blocks,
                            dec.activations)
    t2 = time.thread_time()
    dec.lm_head(rms_norm(x, dec.norm, dec.eps))
    return {"attn_in": t1 - t0, "mlp_out": t2 - t1, "lm_head": time.thread_time() - t2}


def time_batch(runner: ModelRunner, ids: list[int], M: int, args) -> dict[str, list[float]]:
    """Per part, the seconds of each timed step of M fresh sessions after ``ids``."""
    sessions = [runner.open_session() for _ in range(M)]
    samplers = [Sampler(SamplingParams()) for _ in range(M)]  # plain greedy, the engine's batched argmax
    tokens = [int(runner.prefill(s, ids).argmax()) for s in sessions]
    times = {part: [] for part in PARTS}
    for i in range(args.warmup + args.steps):
        t0 = time.thread_time()
        logits, stats = runner.decode(sessions, tokens, with_stats=True)
        t1 = time.thread_time()
        picked = greedy_tokens(samplers, logits)
        t2 = time.thread_time()
        tokens = [picked[r] for r in range(M)]
        alone = products(runner, M, len(ids) + i)
        if i >= args.warmup:
            times["step"].append(t1 - t0)
            times["sampling"].append(t2 - t1)
            times["attention"].append(stats[0].attention_s)
            for part, seconds in alone.items():
                times[part].append(seconds)
            times["other"].append(t1 - t0 - sum(alone.values()) - stats[0].attention_s)
    for s in sessions:
        runner.close_session(s)
    return times


def time_wall(runner: ModelRunner, ids: list[int], args) -> dict[int, dict[str, list[float]]]:
    """Per batch (1 and M) and column (WALL), the seconds of each timed step over the first 1, then all M, of M
    fresh sessions after ``ids``: wall time and the CPU time of every thread of the process."""
    M = args.rows
    sessions = [runner.open_session() for _ in range(M)]
    tokens = [int(runner.prefill(s, ids).argmax()) for s in sessions]
    times = {m: {col: [] for col in WALL} for m in (1, M)}
    clocks = (time.perf_counter, time.thread_time, time.process_time)  # in WALL's order
    for m in times:
        for i in range(args.warmup + args.steps):
            start = [clock() for clock in clocks]
            logits, _ = runner.decode(sessions[:m], tokens[:m])
            took = [clock() - s for clock, s in zip(clocks, start, strict=True)]
            tokens[:m] = logits.argmax(-1).tolist()
            if i >= args.warmup:
                for col, t in zip(WALL, took, strict=True):
                    times[m][col].append(t)
    for s in sessions:
        runner.close_session(s)
    return times


def wall_main(runner: ModelRunner, ids: list[int], args) -> dict[str, dict[int, dict[str, float]]]:
    """The --threads mode: per activations, batch and column the median ms, printed as a table."""
    M = args.rows
    times = {a: {m: {col: [] for col in WALL} for m in (1, M)} for a in args.activations}
    for _ in range(args.rounds):
        for a in args.activations:
            runner.decoder.set_activations(a)
            for m, cols in time_wall(runner, ids, args).items():
                for col, t in cols.items():
                    times[a][m][col] += t
    for t in times.values():
        for cols in t.values():
            cols["alone"] = [2 * main - all_ for main, all_ in zip(cols["main"], cols["all"], strict=True)]
    med = {a: {m: {col: 1e3 * statistics.median(c) for col, c in cols.items()} for m, cols in t.items()}
           for a, t in times.items()}
    print(f"{'activations':>11} {'1 row ms':>9} {f'{M} rows ms':>10} {f'{M} / 1':>7} {'CPU ms: main 1':>15} "
          f"{'all 1':>6} {f'main {M}':>7} {f'all {M}':>6} {f'alone {M}':>8}")
    for a, t in med.items():
        print(f"{a:>11} {t[1]['wall']:>9.2f} {t[M]['wall']:>10.2f} {t[M]['wall'] / t[1]['wall']:>7.2f} "
              f"{t[1]['main']:>15.2f} {t[1]['all']:>6.2f} {t[M]['main']:>7.2f} {t[M]['all']:>6.2f} "
              f"{t[M]['alone']:>8.2f}")
    return med


def parts_table(runner: ModelRunner, ids: list[int], args) -> dict[str, dict[int, float]]:
    """The one-thread mode for the runner's activations: per part the median ms at 1 and M rows, printed."""
    times = {M: {part: [] for part in PARTS} for M in (1, args.rows)}
    for _ in range(args.rounds):
        for M in times:
            for part, t in time_batch(runner, ids, M, args).items():
                times[M][part] += t
    M = args.rows
    med = {part: {m: 1e3 * statistics.median(times[m][part]) for m in times} for part in PARTS}
    print(f"{'part':>10} {'1 row ms':>9} {f'{M} rows ms':>10} {f'{M} / 1':>7} {f'{M} / ({M} x 1)':>10}")
    for part in PARTS:
        one, many = med[part][1], med[part][M]
        ratios = f"{many / one:>7.2f} {many / (M * one):>10.2f}" if one > 0 else f"{'-':>7} {'-':>10}"
        print(f"{part:>10} {one:>9.2f} {many:>10.2f} {ratios}")
    return med


def main(argv=None) -> dict:
    """The parts table of the last activations named (one thread), or with --threads the wall_main table."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runner = ModelRunner(RuntimeConfig(activations=args.activations[0]))
    args.activations = runner.decoder.resolve_activations(args.activations)  # "auto" as the runner resolves it
    ids = runner.encode_chat([{"role": "user", "content": args.prompt}])
    with torch.inference_mode():
        if args.threads > 1:
            print(f"# step_parts: {len(ids)} prompt tokens, weights {runner.decoder.matmul_format}, "
                  f"{torch.get_num_threads()} threads, wall time")
            return wall_main(runner, ids, args)
        for a in args.activations:
            runner.decoder.set_activations(a)
            print(f"# step_parts: {len(ids)} prompt tokens, weights {runner.decoder.weight_format}, one thread")
            med = parts_table(runner, ids, args)
    return med


if __name__ == "__main__":
    main()
