"""Where a ReTopK reuse step spends its time (like the paper's figure 9), against Exact Top-K's stages.

Stages of the reuse path: similarity + path decision, recall + candidate construction (union, sort,
dedup), indexed QK over the candidates, Top-K rerank, sparse softmax-value aggregation, FIFO update.
Exact Top-K: full-history QK + global Top-K, then the same sparse aggregation. One layer of
Qwen2.5-7B shape by default, every stage timed in this process on the same KV. The steps are the
methods' own ``decode`` (torch backend); while the bench runs, each stage's function is replaced by a timed
wrapper of it (``timed_stages``), so the core carries no timing hooks and the stages are those of the real
step. The whole step is timed too: what it has beyond the sum of the stages is the glue between them.

    python bench/attention_stages.py --lengths 16384 131072
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path as FsPath

import torch

from bench.attention_cpu import Workload
from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.kv import PagedKV
from retopk_core.methods import backend_steps, make_method
from retopk_core.methods import retopk as retopk_module
from retopk_core.methods.base import Path

# The functions each stage is made of, by the name the method's module calls them by (stage names as the
# paper's figure 9). ReTopK's reuse step also has three of its own methods timed: see ``timed_stages``.
RETOPK_STAGES = {"head_paths": "similarity+path", "gqa_paths": "similarity+path", "exact_select": "exact QK + top-K",
                 "indexed_scores": "indexed QK", "topk_select": "top-K rerank", "sparse_attend": "sparse attend"}
EXACT_STAGES = {"exact_select": "full QK + top-K", "sparse_attend": "sparse attend"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536, 131072])
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json")
    return p.parse_args(argv)


class StageClock:
    """Seconds per stage, added up over the calls of each stage's functions."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = {}
        self.step = 0.0  # the whole decode steps

    def timed(self, stage: str, fn: Callable) -> Callable:
        """``fn``, its time added to ``stage``."""
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[stage] = self.acc.get(stage, 0.0) + time.perf_counter() - t0
        return run


@contextmanager
def timed_stages(clock: StageClock, module, stages: dict[str, str], attrs: list[tuple[object, str, str]] = ()
                 ) -> Iterator[None]:
    """Within: ``module``'s functions named in ``stages`` and each (object, method name, stage) of ``attrs``
    add their time to ``clock``; restored after."""
    saved = {name: getattr(module, name) for name in stages}
    try:
        for name, stage in stages.items():
            setattr(module, name, clock.timed(stage, saved[name]))
        for obj, name, stage in attrs:
            setattr(obj, name, clock.timed(stage, getattr(obj, name)))  # an instance attribute over the class's
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)
        for obj, name, _ in attrs:
            delattr(obj, name)


def timed_step(method, clock: StageClock, q: torch.Tensor, kv: PagedKV, state, slots: torch.Tensor):
    """One real ``method.decode`` with its stages added to ``clock`` -> its StepOutput."""
    if method.name == "retopk":
        timers = timed_stages(clock, retopk_module, RETOPK_STAGES, [
            (method, "_similarity", "similarity+path"), (method, "_candidates", "recall+candidates"),
            (state, "push", "cache update")])
    else:
        timers = timed_stages(clock, backend_steps, EXACT_STAGES)
    with timers:
        t0 = time.perf_counter()
        res = method.decode(q, kv, state, slots, scale=q.shape[-1] ** -0.5)
        clock.step += time.perf_counter() - t0
    return res


def main(argv=None) -> None:
    args = parse_args(argv)
    enable_transparent_hugepages()  # before the workloads allocate: see retopk_core/hugepages.py
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for L in args.lengths:
        work = Workload(args, L)
        B, H, d = work.shape
        # tau 0 and no refresh: every head reuses, so each step is the reuse path alone
        method = make_method("retopk", top_k=args.top_k, tau=0.0, refresh_every=0)
        exact = make_method("exact_topk", top_k=args.top_k)
        state = method.init_state(H, args.kv_heads, d, capacity=B)
        exact_state = exact.init_state(H, args.kv_heads, d, capacity=B)
        slots = torch.tensor([state.alloc() for _ in range(B)])
        exact_slots = torch.tensor([exact_state.alloc() for _ in range(B)])
        for b in range(B):
            method.prefill(state, int(slots[b]), work.similar(32)[:, b].permute(1, 0, 2), torch.arange(L - 32, L),
                           PagedKV.contiguous(work.k[b:b + 1], work.v[b:b + 1], work.kv.lengths[b:b + 1]))
        reuse, exact_clock, candidates = StageClock(), StageClock(), 0.0
        queries = work.similar(args.steps + 2)
        with torch.inference_mode():  # as the server's runner decodes
            # consecutive reuse steps, then consecutive exact steps, as in attention_cpu's single-path rows
            # (interleaving them lets each exact step's pass over the whole cache evict the reuse path's rows)
            for i, q in enumerate(queries):
                res = timed_step(method, reuse if i >= 2 else StageClock(), q, work.kv, state, slots)  # 2 warm-up
                if i >= 2:
                    candidates += float(res.n_scored[res.path == Path.REUSE].float().mean())
            for i, q in enumerate(queries):
                timed_step(exact, exact_clock if i >= 2 else StageClock(), q, work.kv, exact_state, exact_slots)
        n = args.steps
        step_ms = {"ReTopK reuse": 1e3 * reuse.step / n, "Exact Top-K": 1e3 * exact_clock.step / n}
        reuse, exact = reuse.acc, exact_clock.acc
        M = candidates / n
        r_ms = {k: 1e3 * v / n for k, v in reuse.items()}
        e_ms = {k: 1e3 * v / n for k, v in exact.items()}
        results.append({"L": L, "reuse_ms": r_ms, "exact_ms": e_ms, "mean_candidates": M,
                        "reuse_step_ms": step_ms["ReTopK reuse"], "exact_step_ms": step_ms["Exact Top-K"]})
        print(f"\nL = {L}: mean candidates per head M = {M:.0f}")
        print("| path | stage | ms | share |\n|---|---|---|---|")
        for label, stages in (("ReTopK reuse", r_ms), ("Exact Top-K", e_ms)):
            tot = sum(stages.values())
            for k, v in stages.items():
                print(f"| {label} | {k} | {v:.2f} | {100 * v / tot:.0f}% |")
            print(f"| {label} | sum of stages | {tot:.2f} | |")
            print(f"| {label} | whole step | {step_ms[label]:.2f} | |")
        print(f"Exact Top-K / ReTopK reuse (sum of stages) = {sum(e_ms.values()) / sum(r_ms.values()):.2f}x")
        del work
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
