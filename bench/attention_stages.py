"""Where a ReTopK reuse step spends its time (like the paper's figure 9), against Exact Top-K's stages.

Stages of the reuse path: similarity + path decision, recall + candidate construction (union, sort,
dedup), indexed QK over the candidates, Top-K rerank, sparse softmax-value aggregation, FIFO update.
Exact Top-K: full-history QK + global Top-K, then the same sparse aggregation. One layer of
Qwen2.5-7B shape by default, every stage timed in this process on the same KV.

    python bench/attention_stages.py --lengths 16384 131072
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages

enable_transparent_hugepages()  # before torch allocates anything: see retopk_core/hugepages.py

import torch

from bench.attention_cpu import Workload
from retopk_core.kv import PagedKV
from retopk_core.methods import make_method
from retopk_core.methods.retopk import gqa_paths, head_paths
from retopk_core.methods.sparse import Workspace, exact_select, indexed_scores, kv_heads, sparse_attend, topk_select


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


def _timed(fn, acc: dict, name: str):
    t0 = time.perf_counter()
    result = fn()
    acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
    return result


def reuse_stages(method, work: Workload, state, slots, q: torch.Tensor, acc: dict) -> None:
    """One reuse step, stage by stage, with the same calls ReTopK.decode makes on its reuse path."""
    B, H, d = q.shape
    kv, scale, K = work.kv, d ** -0.5, method.config.top_k
    qn = _timed(lambda: q.float() / q.float().norm(dim=-1, keepdim=True), acc, "similarity+path")
    sim, max_sim = _timed(lambda: method._similarity(qn, state, slots), acc, "similarity+path")
    cfg = method.config
    _timed(lambda: gqa_paths(head_paths(max_sim, state.step[slots], cfg), max_sim, kv.num_kv_heads, cfg), acc,
           "similarity+path")
    b = torch.arange(B).repeat_interleave(H)
    h = torch.arange(H).repeat(B)
    cand = _timed(lambda: method._candidates(sim[b, h], state, slots[b], h, kv.lengths[b]), acc, "recall+candidates")
    g = kv_heads(H, kv.num_kv_heads)[h]
    scores = _timed(lambda: indexed_scores(q[b, h], kv, b, g, cand, scale, method._ws), acc, "indexed QK")
    sp, ss = _timed(lambda: topk_select(scores, cand, K), acc, "top-K rerank")
    _timed(lambda: sparse_attend(kv, sp.view(B, H, K), ss.view(B, H, K), q.dtype, method._ws), acc, "sparse attend")
    _timed(lambda: state.push(slots, qn, sp.view(B, H, K)), acc, "cache update")
    acc["_candidates"] = acc.get("_candidates", 0.0) + float((cand >= 0).sum(-1).float().mean())


def exact_stages(work: Workload, q: torch.Tensor, K: int, acc: dict, ws: Workspace) -> None:
    d = q.shape[-1]
    sp, ss = _timed(lambda: exact_select(q, work.kv, K, d ** -0.5, ws=ws), acc, "full QK + top-K")
    _timed(lambda: sparse_attend(work.kv, sp, ss, q.dtype, ws), acc, "sparse attend")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for L in args.lengths:
        work = Workload(args, L)
        B, H, d = work.shape
        method = make_method("retopk", top_k=args.top_k, tau=0.0, refresh_every=0)
        state = method.init_state(H, args.kv_heads, d, capacity=B)
        slots = torch.tensor([state.alloc() for _ in range(B)])
        for b in range(B):
            method.prefill(state, int(slots[b]), work.similar(32)[:, b].permute(1, 0, 2), torch.arange(L - 32, L),
                           PagedKV.contiguous(work.k[b:b + 1], work.v[b:b + 1], work.kv.lengths[b:b + 1]))
        reuse, exact, exact_ws = {}, {}, Workspace()
        queries = work.similar(args.steps + 2)
        with torch.inference_mode():  # as the server's runner decodes
            # consecutive reuse steps, then consecutive exact steps, as in attention_cpu's single-path rows
            # (interleaving them lets each exact step's pass over the whole cache evict the reuse path's rows)
            for i, q in enumerate(queries):
                reuse_stages(method, work, state, slots, q, {} if i < 2 else reuse)  # two warm-up steps
            for i, q in enumerate(queries):
                exact_stages(work, q, args.top_k, {} if i < 2 else exact, exact_ws)
        n = args.steps
        M = reuse.pop("_candidates") / n
        r_ms = {k: 1e3 * v / n for k, v in reuse.items()}
        e_ms = {k: 1e3 * v / n for k, v in exact.items()}
        results.append({"L": L, "reuse_ms": r_ms, "exact_ms": e_ms, "mean_candidates": M})
        print(f"\nL = {L}: mean candidates per head M = {M:.0f}")
        print("| path | stage | ms | share |\n|---|---|---|---|")
        for label, stages in (("ReTopK reuse", r_ms), ("Exact Top-K", e_ms)):
            tot = sum(stages.values())
            for k, v in stages.items():
                print(f"| {label} | {k} | {v:.2f} | {100 * v / tot:.0f}% |")
            print(f"| {label} | total | {tot:.2f} | |")
        print(f"Exact Top-K / ReTopK reuse (sum of stages) = {sum(e_ms.values()) / sum(r_ms.values()):.2f}x")
        del work
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
