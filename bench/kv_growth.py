"""What one doubling of the KV block pool costs inside the turn that needs it: by copying every block (a pool with no
budget: the way every pool grew before runtime/reserved_rows.py) against widening the views of a reservation (a CPU
pool with a budget, the server's).

Each round builds both pools at ``--blocks`` blocks of the embedded model's shape by default (30 layers, 3 KV heads,
256 positions a block, head dim 64, bfloat16: 16 sessions of 1,000 tokens fill 64 such blocks), writes every block,
and times the ``alloc`` that finds none free and doubles it; the two kinds take turns. Medians and the ratio are
printed, JSON with ``--out``.

    python -m bench.kv_growth --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--blocks", type=int, default=64, help="the pool's blocks before the doubling (default %(default)s)")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON there")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    import torch

    from retopk_server.runtime.budget import CacheBudget
    from retopk_server.runtime.kv_pool import KVPool

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {"copy": [], "in_place": []}
    for _ in range(args.rounds):
        for kind in times:
            block = 2 * args.layers * args.kv_heads * args.block_size * args.head_dim * 2  # bytes, bfloat16
            budget = CacheBudget(4 * args.blocks * block) if kind == "in_place" else None  # room for the doubling
            pool = KVPool(args.layers, args.kv_heads, args.head_dim, args.block_size, torch.bfloat16, "cpu",
                          initial_blocks=args.blocks, budget=budget)
            pool.alloc(args.blocks)
            for t in pool.k + pool.v:
                t.fill_(1.0)  # the blocks in use hold data
            storage = pool.k[0].data_ptr()
            t0 = time.perf_counter()
            pool.alloc(1)
            times[kind].append(time.perf_counter() - t0)
            assert pool.capacity == 2 * args.blocks
            if kind == "in_place" and pool.k[0].data_ptr() != storage:
                raise SystemExit("kv_growth: the system refused the reservation, so both pools grew by copying")
            del pool
    result = {**{k: v for k, v in vars(args).items() if k != "out"}, "seconds": times,
              "median_copy_s": statistics.median(times["copy"]),
              "median_in_place_s": statistics.median(times["in_place"])}
    result["copy_over_in_place"] = result["median_copy_s"] / result["median_in_place_s"]
    print(f"doubling a pool of {args.blocks} blocks: copying {1e3 * result['median_copy_s']:.1f} ms, in place "
          f"{1e3 * result['median_in_place_s']:.2f} ms (medians of {args.rounds}; {result['copy_over_in_place']:.0f}x)")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
