"""ReTopK's fused CPU kernel (backend "cpu") against its torch code (backend "torch"), same process, same KV.

One layer of the embedded model by default (SmolLM2-135M: 9 query heads, 3 KV heads, head dim 64; the
server's K = 64, C = W = 32, R = 4) over a paged KV pool of 256-position blocks, as the server holds it.
Two traces per length: "reuse" (tau = 0, no refresh: every head reuses, the common step) and "exact"
(tau = 1: every head takes the exact path, the fallback / refresh cost). Both backends start from the
same prefilled FIFO and decode the same queries in alternation, step by step, so a slow spell of the
machine hits both; the table gives the median ms per layer-step and the torch / cpu ratio.

    python bench/cpu_kernel.py --lengths 1024 4096 8192 32768 --threads 1 --out docs/bench/cpu_kernel_DATE

``--out`` saves what the table shows, every row, with the command, the machine and its load average, as
<out>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from retopk_core.hugepages import enable_transparent_hugepages

# torch and what imports it load inside the functions: main() first asks for huge pages, which must
# precede torch's first allocation (retopk_core/hugepages.py), and importing this module changes nothing.
if TYPE_CHECKING:
    import torch

    from retopk_core.kv import PagedKV


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--cache-size", type=int, default=32)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--recall", type=int, default=4)
    p.add_argument("--block", type=int, default=256, help="KV block size (positions)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="KV and query dtype")
    p.add_argument("--steps", type=int, default=50, help="timed steps per backend, trace and length")
    p.add_argument("--traces", nargs="+", choices=["reuse", "exact"], default=["reuse", "exact"])
    p.add_argument("--threads", type=int, default=1, help="torch (and kernel) threads")
    p.add_argument("--out", type=Path, default=None, help="also write every row to <out>.json")
    return p.parse_args(argv)


def paged_pool(k: torch.Tensor, v: torch.Tensor, block: int) -> PagedKV:
    """(B, H_kv, L, d) keys/values as a pool of ``block``-position blocks, sequences interleaved block by block."""
    import torch

    from retopk_core.kv import PagedKV

    B, H_kv, L, d = k.shape
    n = -(-L // block)
    pad = n * block - L

    def pool(x):  # (B, H_kv, L, d) -> (n * B, H_kv, block, d), physical block j * B + b = logical block j of b
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(B, H_kv, n, block, d)
        return x.permute(2, 0, 1, 3, 4).reshape(n * B, H_kv, block, d).contiguous()

    table = torch.arange(n).view(1, n) * B + torch.arange(B).view(B, 1)  # (B, n)
    return PagedKV(pool(k), pool(v), table, torch.full((B,), L))


def run_trace(args, L: int, trace: str, seed: int = 0) -> dict:
    import torch

    from retopk_core.kv import PagedKV
    from retopk_core.methods import make_method

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, args.dtype)
    B, H, H_kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    k = torch.randn(B, H_kv, L, d, generator=g).to(dt)
    v = torch.randn(B, H_kv, L, d, generator=g).to(dt)
    kv = paged_pool(k, v, args.block)
    centers = torch.randn(B, H, d, generator=g)

    def similar(n):  # (n, B, H, d) queries near each head's centre
        return (centers + 0.2 * torch.randn(n, B, H, d, generator=g)).to(dt)

    params = dict(top_k=args.top_k, cache_size=args.cache_size, window=args.window, recall=args.recall,
                  tau=0.0 if trace == "reuse" else 1.0, refresh_every=0)
    methods = {name: make_method("retopk", backend=name, **params) for name in ("torch", "cpu")}
    state = methods["torch"].init_state(H, H_kv, d, capacity=B)
    slots = torch.tensor([state.alloc() for _ in range(B)])
    C = args.cache_size
    prompt = similar(C)  # (C, B, H, d)
    for b in range(B):
        one = PagedKV(kv.k_pool, kv.v_pool, kv.block_table[b:b + 1], kv.lengths[b:b + 1])
        methods["torch"].prefill(state, int(slots[b]), prompt[:, b].permute(1, 0, 2), torch.arange(L - C, L), one)
    states = {"torch": state, "cpu": copy.deepcopy(state)}
    times = {name: [] for name in methods}
    scored = []
    queries = similar(args.steps + 3)
    with torch.inference_mode():
        for i, q in enumerate(queries):
            for name in (("torch", "cpu") if i % 2 == 0 else ("cpu", "torch")):  # alternate who goes first
                t0 = time.perf_counter()
                out = methods[name].decode(q, kv, states[name], slots)
                dt_s = time.perf_counter() - t0
                if i >= 3:  # the first steps warm the workspaces and caches
                    times[name].append(dt_s)
                    if name == "cpu":
                        scored.append(float(out.n_scored.float().mean()))
    torch_ms = 1e3 * statistics.median(times["torch"])
    cpu_ms = 1e3 * statistics.median(times["cpu"])
    return {"L": L, "trace": trace, "torch_ms": torch_ms, "cpu_ms": cpu_ms, "ratio": torch_ms / cpu_ms,
            "scored": statistics.mean(scored)}


def main(argv=None) -> int:
    args = parse_args(argv)
    enable_transparent_hugepages()  # before torch is imported: see retopk_core/hugepages.py
    import torch

    from retopk_core.cpu import launch

    torch.set_num_threads(args.threads)
    if not launch.available():
        print("the fused CPU kernel is not available (see the log line above): run `python -m retopk_core.cpu.build`",
              file=sys.stderr)
        return 1
    print(f"B={args.batch} H={args.heads} H_kv={args.kv_heads} d={args.head_dim} K={args.top_k} C={args.cache_size} "
          f"W={args.window} R={args.recall} block={args.block} {args.dtype}, {torch.get_num_threads()} thread(s), "
          f"median of {args.steps} steps")
    print("| L | trace | keys scored / head | torch ms | cpu ms | torch / cpu |")
    print("|---|---|---|---|---|---|")
    load_before, rows = os.getloadavg(), []
    for L in args.lengths:
        for trace in args.traces:
            r = run_trace(args, L, trace)
            rows.append(r)
            print(f"| {r['L']} | {r['trace']} | {r['scored']:.0f} | {r['torch_ms']:.3f} | {r['cpu_ms']:.3f} | "
                  f"{r['ratio']:.1f}x |", flush=True)
    if args.out:
        meta = {"command": "python bench/cpu_kernel.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "load_average_before": load_before[0], "load_average_after": os.getloadavg()[0]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"meta": meta, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
