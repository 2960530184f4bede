"""Calibrate ReTopK's dense floor L_min (``dense_below``): the context length below which full attention
is the faster way to decode on this machine.

For each length L, one layer's decode step at the model's shapes is timed for Full attention and for
ReTopK without a floor (its reuse path, plus a share of heads that fall back: ``--fallback``), in rounds
that alternate the two methods in this process. Queries come from two clusters per head (so the FIFO
holds exact supports of similar queries, as in a real decode) with a share of unrelated ones. Printed:
ms per layer-step and ReTopK's speedup over Full at each L, and the recommended ``dense_below``: the
smallest measured L from which ReTopK stays faster at every longer measured length. Dense attention is
also the better quality below it, so the floor costs nothing there.

Both methods run on ``--backend``: by default the one the server picks for them on this machine (the fused
CPU kernel when it is built), since a floor measured on another implementation says nothing about the server's.

    python -m bench.dense_floor --lengths 256 512 1024 2048 4096 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path as FsPath

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import make_method
from retopk_server.cli import parse_params  # the server's own key=value grammar
from retopk_server.runtime import RuntimeConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192])
    p.add_argument("--heads", type=int, default=9, help="query heads (default: the embedded SmolLM2-135M)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--method", default="top_k=64",
                   help="ReTopK hyperparameters as key=value,... (default: %(default)s); dense_below is forced to 0")
    p.add_argument("--fallback", type=float, default=0.1, help="share of heads with an unrelated query per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per method, length and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--backend", choices=["auto", "cpu", "torch"], default="auto",
                   help="implementation of both methods; auto: what the server runs here (default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json")
    return p.parse_args(argv)


def _queries(n: int, B: int, H: int, d: int, fallback: float, gen: torch.Generator) -> torch.Tensor:
    """(n, B, H, d): each head draws from two fixed directions with noise, a ``fallback`` share at random."""
    centers = torch.randn(B, H, 2, d, generator=gen)
    pick = torch.randint(0, 2, (n, B, H), generator=gen)
    q = centers.unsqueeze(0).expand(n, -1, -1, -1, -1).gather(
        3, pick.view(n, B, H, 1, 1).expand(n, B, H, 1, d)).squeeze(3)
    q = q + 0.1 * torch.randn(n, B, H, d, generator=gen)
    unrelated = torch.rand(n, B, H, generator=gen) < fallback
    return torch.where(unrelated.unsqueeze(-1), 3 * torch.randn(n, B, H, d, generator=gen), q)


def backends(choice: str) -> dict[str, str]:
    """Each method's implementation for ``--backend``, resolved as the server resolves it on a CPU."""
    config = RuntimeConfig(backend=choice, device="cpu")
    return {name: config.method_backend(name) for name in ("full", "retopk")}


def measure(L: int, args, params: dict, gen: torch.Generator, impl: dict[str, str]) -> dict:
    B, H, H_kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    kv = PagedKV.contiguous(torch.randn(B, H_kv, L, d, generator=gen), torch.randn(B, H_kv, L, d, generator=gen))
    full = make_method("full", backend=impl["full"])
    retopk = make_method("retopk", backend=impl["retopk"], **{**params, "dense_below": 0})
    state = retopk.init_state(H, H_kv, d, capacity=B)
    slots = torch.tensor([state.alloc() for _ in range(B)])
    warm = retopk.config.cache_size
    qs = _queries(warm + args.steps * args.rounds, B, H, d, args.fallback, gen)
    with torch.inference_mode():
        for t in range(warm):  # fill the FIFO with real supports of this trace (untimed)
            retopk.decode(qs[t], kv, state, slots)
            full.decode(qs[t], kv, None, None)
        times = {"full": 0.0, "retopk": 0.0}
        for r in range(args.rounds):
            for name, step in (("full", lambda q: full.decode(q, kv, None, None)),
                               ("retopk", lambda q: retopk.decode(q, kv, state, slots))):
                t0 = time.perf_counter()
                for t in range(args.steps):
                    step(qs[warm + r * args.steps + t])
                times[name] += time.perf_counter() - t0
    n = args.steps * args.rounds
    row = {"length": L, "full_ms": 1e3 * times["full"] / n, "retopk_ms": 1e3 * times["retopk"] / n}
    row["speedup"] = row["full_ms"] / row["retopk_ms"]
    return row


def recommend(rows: list[dict]) -> int:
    """The smallest measured L from which ReTopK is faster at every longer measured L (the largest L + 1
    when it is not faster at the longest). Rows sorted by length."""
    floor = rows[-1]["length"] + 1
    for row in reversed(rows):
        if row["speedup"] <= 1.0:
            break
        floor = row["length"]
    return floor


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = parse_params(args.method)
    gen = torch.Generator().manual_seed(0)
    impl = backends(args.backend)
    rows = []
    print(f"{'L':>7} {'full ms':>9} {'retopk ms':>10} {'speedup':>8}", flush=True)
    for L in sorted(args.lengths):
        row = measure(L, args, params, gen, impl)
        rows.append(row)
        print(f"{L:>7} {row['full_ms']:>9.3f} {row['retopk_ms']:>10.3f} {row['speedup']:>7.2f}x", flush=True)
    floor = recommend(rows)
    print(f"recommended dense_below = {floor} (threads {torch.get_num_threads()}, batch {args.batch}, "
          f"backends {impl})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"rows": rows, "dense_below": floor, "threads": torch.get_num_threads(), "args": vars(args),
             "backends": impl},
            indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
