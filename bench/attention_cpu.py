"""Attention latency per decode step: Full, Exact Top-K, ReTopK (and the baselines), same run.

Shapes default to Qwen2.5-7B layers (28 query heads, 4 KV heads, head dim 128) with K = 512.
Keys/values are random; queries come from a few clusters per head so that ReTopK's cache holds
real exact supports of similar queries (its candidate sets then overlap as in the paper). ReTopK is
timed on two traces: its reuse path alone (every step reuses), and a path mix where a chosen share of
steps brings an unrelated query (the whole step falls back), plus scheduled refresh. Every method is
timed in this process on the same KV, in rounds that alternate the methods, and the ratio to Exact
Top-K is printed. ``--layers N`` decodes N independent layers per step, as a model does (28 for all
of Qwen2.5-7B); times are per layer-step.

    python -m bench.attention_cpu --lengths 16384 32768 65536 131072 262144 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages

enable_transparent_hugepages()  # before torch allocates anything: see retopk_core/hugepages.py

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method, method_names


def baseline_params(K: int, d: int) -> dict[str, dict]:
    """The paper's baseline settings at budget K, scaled from K = 512, d = 128 (64 sinks + 448 recent;
    TokenSelect 64 initial + 416 selected + 32 local; Loki rank 64)."""
    return {"streaming_llm": {"top_k": K, "sinks": K // 8}, "quest": {"top_k": K, "page_size": min(16, K)},
            "sparq": {"top_k": K}, "loki": {"top_k": K, "rank": max(1, d // 2)},
            "tokenselect": {"top_k": K, "initial": max(1, K // 8), "local": max(1, K // 16)}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16384, 32768, 65536, 131072, 262144])
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--steps", type=int, default=25, help="timed decode steps per method, length and round")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds; methods take turns round by round")
    p.add_argument("--layers", type=int, default=1,
                   help="independent layers (own KV, own state) decoded in turn per step, as in a model")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method before the rounds")
    p.add_argument("--exact-share", type=float, default=0.12,
                   help="share of steps with an unrelated query in the path-mix trace (paper: about 12%%)")
    p.add_argument("--baselines", action="store_true", help="also time the baselines that are registered")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json and <out>.png")
    return p.parse_args(argv)


class Workload:
    """Random KV of B sequences at length L and clustered queries, built once per length."""

    def __init__(self, args, L: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        dt = getattr(torch, args.dtype)
        B, H, H_kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
        self.k = torch.randn(B, H_kv, L, d, generator=g).to(dt)
        self.v = torch.randn(B, H_kv, L, d, generator=g).to(dt)
        self.kv = PagedKV.contiguous(self.k, self.v, torch.full((B,), L))
        self.centers = torch.randn(B, H, d, generator=g)
        self.g, self.dt, self.shape = g, dt, (B, H, d)

    def similar(self, n: int) -> torch.Tensor:  # (n, B, H, d) queries close to the cluster centers
        return (self.centers + 0.2 * torch.randn(n, *self.shape, generator=self.g)).to(self.dt)

    def unrelated(self) -> torch.Tensor:  # (B, H, d)
        return torch.randn(*self.shape, generator=self.g).to(self.dt)


class Timed:
    """One method decoding through ``layers`` independent layers (each its own KV and state), timed by step.

    A step runs the method on every layer in turn, as a model's decode step does; with more layers
    than one, each layer's keys have left the CPU caches by the time it comes round again (one layer
    at 128K is 512 MB of float32 K/V), which a single-layer loop does not show.
    """

    def __init__(self, method, works: list[Workload]):
        B, H, d = works[0].shape
        self.method, self.works = method, works
        self.states, self.slots = [], []
        n = method.prefill_queries
        for work in works:
            state = method.init_state(H, work.kv.num_kv_heads, d, capacity=B)
            slots = torch.tensor([state.alloc() for _ in range(B)])
            L = int(work.kv.lengths[0])
            for b in range(B):
                q_tail = work.similar(max(n, 1))[:, b].permute(1, 0, 2) if n else None  # (H, n, d)
                pos = torch.arange(L - max(n, 1), L) if n else None
                method.prefill(state, int(slots[b]), q_tail, pos,
                               PagedKV.contiguous(work.k[b:b + 1], work.v[b:b + 1], work.kv.lengths[b:b + 1]))
            self.states.append(state)
            self.slots.append(slots)
        self.times: list[float] = []  # seconds per step, all layers
        self.paths: dict[str, int] = {}
        self.scored: list[float] = []

    @torch.inference_mode()  # as the server's runner decodes
    def run(self, queries: list[list[torch.Tensor]], timed: bool) -> None:
        """Decode one step per entry of ``queries`` (each a (B, H, d) query per layer)."""
        for step in queries:
            t0 = time.perf_counter()
            outs = [self.method.decode(q, w.kv, st, sl)
                     for q, w, st, sl in zip(step, self.works, self.states, self.slots, strict=True)]
            dt = time.perf_counter() - t0
            if timed:
                self.times.append(dt)
                for out in outs:
                    for p in out.path.flatten().tolist():
                        name = Path(p).name.lower()
                        self.paths[name] = self.paths.get(name, 0) + 1
                    self.scored.append(out.n_scored.float().mean().item())


def traces(works: list[Workload], n: int, exact_share: float) -> tuple[list, list]:
    """n steps of per-layer queries: all similar, and the same with a share of steps unrelated (spread evenly)."""
    similar = [[q for q in w.similar(n)] for w in works]  # (layers, n) of (B, H, d)
    mix = [list(qs) for qs in similar]
    n_unrelated = round(exact_share * n)
    for j in range(n_unrelated):
        i = int(j * n / n_unrelated)
        for layer, w in enumerate(works):
            mix[layer][i] = w.unrelated()
    return [list(step) for step in zip(*similar, strict=True)], [list(step) for step in zip(*mix, strict=True)]


def run(args) -> list[dict]:
    rows = []
    for L in args.lengths:
        works = [Workload(args, L, seed=layer) for layer in range(args.layers)]
        K = args.top_k
        methods = {"full": make_method("full"), "exact_topk": make_method("exact_topk", top_k=K),
                   "retopk_reuse": make_method("retopk", top_k=K, tau=0.0, refresh_every=0),
                   "retopk_mix": make_method("retopk", top_k=K)}
        if args.baselines:
            for name, params in baseline_params(K, args.head_dim).items():
                if name in method_names():
                    methods[name] = make_method(name, **params)
        timers = {name: Timed(m, works) for name, m in methods.items()}
        similar, mix = traces(works, args.warmup + args.steps, args.exact_share)
        for name, t in timers.items():  # warm-up
            t.run((mix if name == "retopk_mix" else similar)[:args.warmup], timed=False)
        # methods take turns round by round, so a slow spell of the machine hits all of them alike
        for _ in range(args.rounds):
            timed_sim, timed_mix = traces(works, args.steps, args.exact_share)  # fresh: a repeat would be recalled
            for name, t in timers.items():
                t.run(timed_mix if name == "retopk_mix" else timed_sim, timed=True)
        for name, t in timers.items():
            ms = [1e3 * x / args.layers for x in t.times]  # per layer-step
            rows.append({"L": L, "method": name, "ms": sum(ms) / len(ms), "median_ms": sorted(ms)[len(ms) // 2],
                         "model_step_ms": sum(t.times) / len(t.times) * 1e3, "paths": t.paths,
                         "mean_scored": sum(t.scored) / len(t.scored)})
        exact_ms = next(r["ms"] for r in rows if r["L"] == L and r["method"] == "exact_topk")
        for r in rows:
            if r["L"] == L:
                r["speedup_vs_exact"] = exact_ms / r["ms"]
        del works, timers
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| L | method | ms per layer-step (mean) | median | vs Exact Top-K (mean) | keys scored (mean/head) "
             "| paths |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        total = sum(r["paths"].values()) or 1
        mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(r["paths"].items()))
        lines.append(f"| {r['L']} | {r['method']} | {r['ms']:.2f} | {r['median_ms']:.2f} | "
                     f"{r['speedup_vs_exact']:.2f}x | {r['mean_scored']:.0f} | {mix} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: FsPath) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["L"], r["ms"]) for r in rows if r["method"] == name]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L")
    ax.set_ylabel("ms per decode step (one layer)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# attention_cpu: {args.layers} layer(s), H={args.heads}"
          f" H_kv={args.kv_heads} d={args.head_dim} K={args.top_k} B={args.batch} "
          f"{args.dtype}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}", flush=True)
    rows = run(args)
    print(table(rows))
    for L in args.lengths:
        by = {r["method"]: r for r in rows if r["L"] == L}
        print(f"L={L}: Exact/ReTopK-reuse = {by['retopk_reuse']['speedup_vs_exact']:.2f}x, "
              f"Exact/ReTopK-mix = {by['retopk_mix']['speedup_vs_exact']:.2f}x")
    reuse = [r["ms"] for r in rows if r["method"] == "retopk_reuse"]
    if len(reuse) > 1:
        print(f"reuse path max/min over lengths: {max(reuse) / min(reuse):.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                             "rows": rows}, indent=1))
        plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
