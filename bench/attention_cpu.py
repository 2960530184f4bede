"""Attention latency per decode step: Full, Exact Top-K and ReTopK under several fallback patterns, same run.

Shapes default to Qwen2.5-7B layers (28 query heads in 4 KV groups of 7, head dim 128) with K = 512.
Keys/values are random. Under GQA a head on an exact path reads every key of its KV group, so what a
ReTopK step costs is how many (layer, sequence, KV group) have their keys read in full (the
group-read rate), and that depends on which heads fall back together. ReTopK is timed on these query
patterns (``--pattern``; rows in this order):

  per-head    on each step and layer, each head's query is unrelated to its past with probability
              --head-p (default 0.10), and otherwise drawn around one of a few cluster centres (cosine
              about 0.96 to its cached neighbours). Heads decide independently, so a group of G heads is
              read with probability about 1 - (1 - p)^G (52% at G = 7, p = 0.1). The realistic
              synthetic case for the per-head decisions; the 'group' policy's mean over a group with
              one unrelated head lands near tau = 0.85 here, so its row on this pattern says more
              about the synthetic cosines than about the policy (the replay is its test).
  replay      each head's max cached-query similarity rho, step by step, from a recording of the
              embedded model (bench/record_paths.py; --replay, default docs/bench/paths_smollm2_kjv.json).
              The query is q = rho q_prev + sqrt(1 - rho^2) u, q_prev the head's previous query (unit)
              and u a random unit vector orthogonal to every query in the head's FIFO, so its max cached-
              query similarity is exactly rho (for rho >= 0 and head_dim > C; with head_dim <= C, u is
              only orthogonal to q_prev and the max is about rho). Every GQA policy then decides on the
              recorded similarities. The FIFO's queries do not depend on the paths taken (every step
              pushes its query), so one precomputed trace serves every method.
  replay-paths  each head's recorded *path*, step by step (--replay-paths, default
              docs/bench/paths_smollm2_kjv_default.json, a recording of the server's default method):
              rho = 0.99 where the recording reused (or refreshed: the bench keeps its own schedule) and
              0 where it took an exact path, so the per-head rule at any tau in (0, 0.99) takes exactly the
              recorded decisions. For decisions that a fixed tau cannot replay: per-head thresholds
              calibrated online (``tau_calibration``) move each head's tau with the recall of its exact
              steps, which the bench's random keys do not reproduce. Its rows are meaningful for the
              per-head policy only (the others decide on these 0 / 0.99 similarities).
  whole-step  --exact-share of the steps (default 0.12, the paper's exact share, spread evenly) bring an
              unrelated query to every head of every layer. The kindest case: every head of a step
              falls back together, so the exact share costs the fewest group reads.

How a recording maps onto the bench's shape. The recording has L_r layers of H_r heads (SmolLM2-135M:
30 layers, 9 heads in 3 KV groups of 3, head dim 64, K = 64 at a 4K context); the bench has n_layers
x H_kv groups of G heads (28 heads in 4 groups of 7). Bench group j, counted over sequences, layers
and groups (j = (b n_layers + layer) H_kv + g) of n_groups, replays recorded layer floor(j L_r /
n_groups) while n_groups <= L_r (one bench layer: recorded layers 0, 7, 15, 22), else layer j mod
L_r; its G heads replay heads (j G + i) mod H_r, i < G, of that layer (distinct while G <= H_r: a
bench group of 7 holds 7 of the layer's 9 heads, from all 3 of its KV groups). Bench step t replays
recorded step t mod T (longer runs wrap, and from step T_r = 128 on meet the bench's own refresh).
Kept: each head's recorded similarities in step order, and which heads of a layer fall back on the
same step. Not kept: a recorded KV group has 3 heads, not 7, so how much more often the 7 heads
sharing one real KV group fall back together than heads of different groups is not in the data (the
replay may over- or under-state group reads); the similarities are SmolLM2's (head dim 64), not a 7B
model's; one bench layer samples only a few recorded layers (the run prints their recorded rates
beside the whole recording's). The decisions are the bench's own: --tau other than the recording's
0.85 moves them.

Rows: Full, Exact Top-K, the reuse path alone (tau = 0, no refresh: every head reuses; a floor, not a
workload) and the baselines decode clustered queries without unrelated ones (what Full and Exact
Top-K do does not depend on the queries); then ReTopK per pattern and GQA policy (``--policies head
promote group``, ``--tau``, ``--group-tau-min``, T_r = 128). Each row: ms per layer-step, the ratio
to Exact Top-K, the share of heads on an exact path (fallback, refresh or promoted) and the
group-read rate. Every method is timed in this process on the same KV, in rounds that alternate the
methods. ``--layers N`` decodes N independent layers per step, as a model does (28 for all of
Qwen2.5-7B); times are per layer-step.

    python -m bench.attention_cpu --lengths 16384 32768 65536 131072 262144 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages

enable_transparent_hugepages()  # before torch allocates anything: see retopk_core/hugepages.py

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method, method_names
from retopk_core.methods.base import FULL_READ_PATHS, group_reads
from retopk_core.retopk_config import GQA_POLICIES, ReTopKConfig
from retopk_server.cli import parse_params  # the server's key=value grammar

PATTERNS = {"per-head": "each head alone gets an unrelated query with probability --head-p",
            "replay": "each head's max cached-query similarity replayed from a recording of the embedded model",
            "replay-paths": "each head's exact / reuse decisions replayed from a recording of the server default",
            "whole-step": "kindest case: every head of a step falls back together"}
DEFAULT_REPLAY = FsPath(__file__).resolve().parent.parent / "docs" / "bench" / "paths_smollm2_kjv.json"
DEFAULT_REPLAY_PATHS = DEFAULT_REPLAY.with_name("paths_smollm2_kjv_default.json")


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
    p.add_argument("--pattern", nargs="+", choices=list(PATTERNS), default=list(PATTERNS),
                   help="query patterns ReTopK is timed on (default: all, in this order)")
    p.add_argument("--policies", nargs="+", choices=GQA_POLICIES, default=list(GQA_POLICIES),
                   help="ReTopK GQA policies, one row each per pattern (default: all)")
    p.add_argument("--tau", type=float, default=ReTopKConfig.tau, help="ReTopK's fallback threshold")
    p.add_argument("--group-tau-min", type=float, default=ReTopKConfig.group_tau_min,
                   help="'group' policy: the lowest max-similarity of a group that still lets it reuse")
    p.add_argument("--head-p", type=float, default=0.10,
                   help="per-head pattern: probability that a head's query is unrelated on a step")
    p.add_argument("--exact-share", type=float, default=0.12,
                   help="whole-step pattern: share of steps with an unrelated query (paper: about 12%%)")
    p.add_argument("--replay", type=FsPath, default=DEFAULT_REPLAY,
                   help="replay pattern: a recording of bench/record_paths.py (default: %(default)s)")
    p.add_argument("--replay-paths", type=FsPath, default=DEFAULT_REPLAY_PATHS,
                   help="replay-paths pattern: a recording of bench/record_paths.py (default: %(default)s)")
    p.add_argument("--baselines", action="store_true", help="also time the baselines that are registered")
    p.add_argument("--params", type=parse_params, default={},
                   help='more ReTopK hyperparameters for the policy rows, e.g. "cache_size=64,window=128"')
    p.add_argument("--backend", choices=["torch", "cpu"], default="torch",
                   help="ReTopK's implementation: the torch reference or the fused CPU kernel (retopk_core/cpu); "
                        "with cpu, Exact Top-K also runs in that kernel (ReTopK at tau = 1: every step exact) "
                        "and the ratio against it is shown beside the one against the torch Exact Top-K")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json and <out>.png")
    args = p.parse_args(argv)
    if not 0.0 <= args.head_p <= 1.0 or not 0.0 <= args.exact_share <= 1.0:
        p.error("--head-p and --exact-share must lie in [0, 1]")
    if args.heads % args.kv_heads:
        p.error("--heads must be a multiple of --kv-heads")
    return args


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

    def unrelated(self, n: int) -> torch.Tensor:  # (n, B, H, d)
        return torch.randn(n, *self.shape, generator=self.g).to(self.dt)


class Replay:
    """A recording of bench/record_paths.py mapped onto the bench's shape (the module docstring says how).

    max_sim (T, L_r, H_r) float32 (NaN where none was recorded), path (T, L_r, H_r) int8 Path codes.
    """

    def __init__(self, file: FsPath):
        if not file.exists():
            raise SystemExit(f"replay recording {file} not found: record one with python -m bench.record_paths, "
                             "or leave 'replay' out of --pattern")
        rec = json.loads(file.read_text())
        self.file, self.meta = file, rec["meta"]
        self.max_sim = torch.tensor([[[float("nan") if x is None else x for x in row] for row in step]
                                     for step in rec["max_sim"]], dtype=torch.float32)
        self.path = torch.tensor([[[int(c) for c in row] for row in step] for step in rec["path"]], dtype=torch.int8)

    def streams(self, B: int, n_layers: int, H: int, H_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Recorded (layer, head) replayed by each bench (sequence, layer, head): two (B, n_layers, H) int64."""
        _, L_r, H_r = self.max_sim.shape
        G, n_groups = H // H_kv, B * n_layers * H_kv
        j = torch.arange(n_groups)  # bench group, (b * n_layers + layer) * H_kv + g
        layer = j * L_r // n_groups if n_groups <= L_r else j % L_r  # (n_groups,)
        head = (j.view(-1, 1) * G + torch.arange(G).view(1, -1)) % H_r  # (n_groups, G)
        return layer.view(-1, 1).expand(-1, G).reshape(B, n_layers, H), head.reshape(B, n_layers, H)

    def take(self, values: torch.Tensor, n: int, B: int, n_layers: int, H: int, H_kv: int) -> torch.Tensor:
        """values (T, L_r, H_r) -> (n, n_layers, B, H): bench step t replays recorded step t mod T."""
        layer, head = self.streams(B, n_layers, H, H_kv)
        t = (torch.arange(n) % values.shape[0]).view(n, 1, 1, 1)
        return values[t, layer.unsqueeze(0), head.unsqueeze(0)].transpose(1, 2)

    def describe(self, B: int, n_layers: int, H: int, H_kv: int) -> dict:
        """What is replayed, with the recorded rates of the replayed heads beside the whole recording's."""
        layer, _ = self.streams(B, n_layers, H, H_kv)
        T, L_r, H_r = self.path.shape
        mine = self.take(self.path, T, B, n_layers, H, H_kv)  # (T, n_layers, B, H)
        m = self.meta
        return {"file": self.file.name, "recorded": f"{m['model']}: {L_r} layers, {H_r} heads in {m['kv_heads']} "
                f"KV groups, K={m['method']['top_k']}, {m['context']} + {T} tokens of {m['corpus']}",
                "recorded_layers_replayed": sorted(set(layer.flatten().tolist())),
                "recorded_head_exact_share": {"replayed": exact_share(mine), "all": exact_share(self.path)},
                "recorded_group_read_rate": {"as_recorded_all": read_rate(self.path, m["kv_heads"]),
                                             "replayed_regrouped": read_rate(mine, H_kv)}}


def exact_share(path: torch.Tensor) -> float:
    """Share of heads on a path that reads their whole KV group (``FULL_READ_PATHS``)."""
    return float(sum((path == p).sum() for p in FULL_READ_PATHS)) / max(1, path.numel())


def read_rate(path: torch.Tensor, num_kv_heads: int) -> float:
    """The group-read rate of path (..., H): the share of (..., KV group) whose keys were read in full."""
    reads = group_reads(path, num_kv_heads)
    return int(reads.sum()) / max(1, reads.numel())


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def walk(prefill: torch.Tensor, rho: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Queries whose max cosine to the head's FIFO is rho: prefill (B, H, C, d), rho (n, B, H) -> (n, B, H, d).

    q_t = rho_t q_{t-1} + sqrt(1 - rho_t^2) u_t with u_t a random unit vector orthogonal to the FIFO's C
    queries (to q_{t-1} only when d <= C), so cos(q_t, q_c) = rho_t cos(q_{t-1}, q_c) <= rho_t for rho_t >= 0.
    The FIFO is the method's: the C prefill queries, then every query pushed as it is decoded.
    """
    fifo = _unit(prefill.float())  # (B, H, C, d) ring, oldest entry at t % C
    C, d = fifo.shape[-2:]
    prev = fifo[:, :, -1]  # (B, H, d)
    out = []
    for t in range(rho.shape[0]):
        r = torch.randn(prev.shape, generator=g)  # (B, H, d)
        if d > C:
            basis = torch.linalg.qr(fifo.transpose(-1, -2)).Q  # (B, H, d, C) orthonormal span of the FIFO
            r = r - (basis @ (basis.transpose(-1, -2) @ r.unsqueeze(-1))).squeeze(-1)
        else:
            r = r - (r * prev).sum(-1, keepdim=True) * prev
        rt = rho[t].clamp(-1.0, 1.0).unsqueeze(-1)  # (B, H, 1)
        prev = rt * prev + (1 - rt * rt).sqrt() * _unit(r)
        fifo[:, :, t % C] = prev
        out.append(prev)
    return torch.stack(out)


def slices(args) -> list[tuple[int, int]]:
    """(start, end) of the warm-up steps, then of each round's timed steps, in one trace."""
    bounds = [0, args.warmup] + [args.warmup + (r + 1) * args.steps for r in range(args.rounds)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


@dataclass
class Trace:
    """One pattern's queries: prefill[layer] (B, H, C, d), the prompt's last queries; steps[i][layer] (B, H, d)."""

    prefill: list[torch.Tensor]
    steps: list[list[torch.Tensor]]


def make_trace(pattern: str, works: list[Workload], args, replay: dict[str, Replay]) -> Trace:
    """warm-up + rounds x steps consecutive decode steps of ``pattern`` for every layer (one FIFO history:
    a query repeated in a later round would be recalled)."""
    C = ReTopKConfig().cache_size
    n = args.warmup + args.rounds * args.steps
    B, H, _ = works[0].shape
    prefill = [w.similar(C).permute(1, 2, 0, 3) for w in works]  # (B, H, C, d) per layer
    if pattern.startswith("replay"):
        rec = replay[pattern]
        if pattern == "replay":
            rho = rec.take(rec.max_sim, n, B, len(works), H, args.kv_heads)  # (n, layers, B, H)
        else:  # the recorded decisions: exact -> 0 (below any tau), reuse or refresh -> 0.99
            exact = sum(rec.path == p for p in (Path.FALLBACK, Path.PROMOTED, Path.DENSE))  # (T, L_r, H_r)
            rho = rec.take(torch.where(exact.bool(), 0.0, 0.99), n, B, len(works), H, args.kv_heads)
        if bool(rho.isnan().any()):
            raise SystemExit(f"{rec.file}: the replayed heads have steps without a recorded similarity")
        per_layer = [walk(pre, rho[:, i], w.g).to(w.dt) for i, (pre, w) in enumerate(zip(prefill, works, strict=True))]
    else:
        if pattern in ("per-head", "similar"):  # "similar": no unrelated query, for the rows without a pattern
            p = args.head_p if pattern == "per-head" else 0.0
            masks = [torch.rand(n, B, H, generator=w.g) < p for w in works]  # (n, B, H)
        else:  # whole-step: round(share * m) steps of each slice of m steps, spread evenly
            mask = torch.zeros(n, dtype=torch.bool)
            for s, e in slices(args):
                k = round(args.exact_share * (e - s))
                mask[[s + int(j * (e - s) / k) for j in range(k)]] = True
            masks = [mask.view(n, 1, 1).expand(n, B, H)] * len(works)
        per_layer = [torch.where(m.unsqueeze(-1), w.unrelated(n), w.similar(n))
                     for m, w in zip(masks, works, strict=True)]
    return Trace(prefill, [[q[i] for q in per_layer] for i in range(n)])


class Timed:
    """One method decoding through ``layers`` independent layers (each its own KV and state), timed by step.

    A step runs the method on every layer in turn, as a model's decode step does; with more layers
    than one, each layer's keys have left the CPU caches by the time it comes round again (one layer
    at 128K is 512 MB of float32 K/V), which a single-layer loop does not show.
    """

    def __init__(self, method, works: list[Workload], prefill: list[torch.Tensor]):
        B, H, d = works[0].shape
        self.method, self.works = method, works
        self.states, self.slots = [], []
        n = method.prefill_queries
        for work, pre in zip(works, prefill, strict=True):
            state = method.init_state(H, work.kv.num_kv_heads, d, capacity=B)
            slots = torch.tensor([state.alloc() for _ in range(B)])
            L = int(work.kv.lengths[0])
            for b in range(B):
                method.prefill(state, int(slots[b]), pre[b, :, -n:] if n else None,
                               torch.arange(L - min(n, pre.shape[2]), L) if n else None,
                               PagedKV.contiguous(work.k[b:b + 1], work.v[b:b + 1], work.kv.lengths[b:b + 1]))
            self.states.append(state)
            self.slots.append(slots)
        self.times: list[float] = []  # seconds per step, all layers
        self.paths: dict[str, int] = {}
        self.scored: list[float] = []
        self.path_log: list[torch.Tensor] = []  # (layers, B, H) int8 per timed step

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
                self.path_log.append(torch.stack([out.path for out in outs]))
                for out in outs:
                    for p in out.path.flatten().tolist():
                        name = Path(p).name.lower()
                        self.paths[name] = self.paths.get(name, 0) + 1
                    self.scored.append(out.n_scored.float().mean().item())

    def row(self, layers: int, num_kv_heads: int) -> dict:
        ms = [1e3 * x / layers for x in self.times]  # per layer-step
        log = torch.stack(self.path_log)  # (steps, layers, B, H)
        return {"ms": sum(ms) / len(ms), "median_ms": sorted(ms)[len(ms) // 2],
                "model_step_ms": sum(self.times) / len(self.times) * 1e3, "paths": self.paths,
                "mean_scored": sum(self.scored) / len(self.scored), "head_exact_share": exact_share(log),
                "group_read_rate": read_rate(log, num_kv_heads)}


def methods_at(args) -> list[tuple[dict, object]]:
    """(row fields, method) of every row of one length, in table order."""
    K, backend = args.top_k, args.backend
    rows = [({"method": "full"}, make_method("full")),
            ({"method": "exact_topk"}, make_method("exact_topk", top_k=K))]
    if backend == "cpu":  # the same kernel with every head on the exact path: the same-implementation baseline
        rows.append(({"method": "exact_topk_cpu"}, make_method("retopk", top_k=K, tau=1.0, refresh_every=1,
                                                               backend="cpu")))
    rows.append(({"method": "retopk_reuse"}, make_method("retopk", top_k=K, tau=0.0, refresh_every=0, backend=backend)))
    if args.baselines:
        rows += [({"method": name}, make_method(name, **params))
                 for name, params in baseline_params(K, args.head_dim).items() if name in method_names()]
    for pattern in args.pattern:
        for policy in args.policies:
            rows.append(({"method": "retopk", "pattern": pattern, "policy": policy},
                         make_method("retopk", **{"top_k": K, "tau": args.tau, "group_tau_min": args.group_tau_min,
                                                  "gqa_policy": policy, "backend": backend, **args.params})))
    return rows


def label(r: dict) -> str:
    if r.get("pattern"):
        return f"retopk {r['policy']} / {r['pattern']}"
    return {"retopk_reuse": "retopk reuse only (floor)",
            "exact_topk_cpu": "exact top-k (fused cpu kernel)"}.get(r["method"], r["method"])


def run(args, replay: dict[str, Replay] | None = None) -> list[dict]:
    rows = []
    for L in args.lengths:
        works = [Workload(args, L, seed=layer) for layer in range(args.layers)]
        traces = {p: make_trace(p, works, args, replay) for p in ["similar", *args.pattern]}
        timers = []  # (trace, timer, row fields)
        for fields, m in methods_at(args):
            trace = traces[fields.get("pattern", "similar")]
            timers.append((trace, Timed(m, works, trace.prefill), fields))
        spans = slices(args)
        for trace, t, _ in timers:  # warm-up
            t.run(trace.steps[slice(*spans[0])], timed=False)
        # methods take turns round by round, so a slow spell of the machine hits all of them alike
        for span in spans[1:]:
            for trace, t, _ in timers:
                t.run(trace.steps[slice(*span)], timed=True)
        at_L = [{"L": L, **fields, **t.row(args.layers, args.kv_heads)} for _, t, fields in timers]
        exact_ms = next(r["ms"] for r in at_L if r["method"] == "exact_topk")
        same_ms = next((r["ms"] for r in at_L if r["method"] == "exact_topk_cpu"), None)
        for r in at_L:
            r["label"] = label(r)
            r["backend"] = args.backend if r["method"].startswith("retopk") or r["method"] == "exact_topk_cpu" \
                else "torch"
            r["speedup_vs_exact"] = exact_ms / r["ms"]
            r["speedup_vs_exact_same_kernel"] = None if same_ms is None else same_ms / r["ms"]
        rows += at_L
        del works, timers, traces
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| L | method | pattern | ms per layer-step (mean) | median | vs Exact Top-K (mean) "
             "| vs Exact Top-K, same kernel | heads exact | groups read | keys scored (mean/head) | paths |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        total = sum(r["paths"].values()) or 1
        mix = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(r["paths"].items()))
        pattern = {None: "", "whole-step": "whole-step (kindest)"}.get(r.get("pattern"), r.get("pattern"))
        name = f"retopk {r['policy']}" if r.get("policy") else label(r)
        same = r.get("speedup_vs_exact_same_kernel")
        lines.append(f"| {r['L']} | {name} | {pattern} | {r['ms']:.2f} | {r['median_ms']:.2f} | "
                     f"{r['speedup_vs_exact']:.2f}x | {'' if same is None else f'{same:.2f}x'} | "
                     f"{100 * r['head_exact_share']:.0f}% | "
                     f"{100 * r['group_read_rate']:.0f}% | {r['mean_scored']:.0f} | {mix} |")
    return "\n".join(lines)


def summary(rows: list[dict], args) -> str:
    """Per length: Exact Top-K / ReTopK for each pattern and policy, the realistic patterns first."""
    lines = []
    for L in args.lengths:
        at = [r for r in rows if r["L"] == L]
        parts = []
        for pattern in args.pattern:
            cells = ", ".join(f"{r['policy']} {r['speedup_vs_exact']:.2f}x ({100 * r['group_read_rate']:.0f}% "
                              "groups read)" for r in at if r.get("pattern") == pattern)
            parts.append(f"{pattern}{' (kindest case)' if pattern == 'whole-step' else ''}: {cells}")
        floor = next(r for r in at if r["method"] == "retopk_reuse")["speedup_vs_exact"]
        lines.append(f"L={L}: Exact/ReTopK: " + "; ".join(parts) + f"; reuse path only (floor) {floor:.2f}x")
    return "\n".join(lines)


def plot(rows: list[dict], path: FsPath) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    styles = {"head": "-", "promote": "--", "group": ":"}  # ReTopK: colour by pattern, line style by policy
    pattern_colors = {"per-head": "tab:red", "replay": "tab:purple", "replay-paths": "tab:pink",
                      "whole-step": "tab:gray"}
    other_colors = iter(["tab:blue", "tab:orange", "tab:green", "tab:olive", "tab:cyan", "tab:pink", "tab:brown",
                         "black"] * 2)
    for name in dict.fromkeys(r["label"] for r in rows):
        pts = [r for r in rows if r["label"] == name]
        pattern = pts[0].get("pattern")
        ax.plot([r["L"] for r in pts], [r["ms"] for r in pts], marker="o", label=name,
                color=pattern_colors[pattern] if pattern else next(other_colors),
                linestyle=styles.get(pts[0].get("policy"), "-"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length L")
    ax.set_ylabel("ms per decode step (one layer)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    files = {"replay": args.replay, "replay-paths": args.replay_paths}
    replay = {p: Replay(files[p]) for p in args.pattern if p in files}
    print(f"# attention_cpu: {args.layers} layer(s), H={args.heads}"
          f" H_kv={args.kv_heads} d={args.head_dim} K={args.top_k} B={args.batch} "
          f"{args.dtype}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}", flush=True)
    notes = {p: PATTERNS[p] for p in args.pattern}
    notes.update({"per-head": f"{PATTERNS['per-head']} = {args.head_p}"} if "per-head" in notes else {})
    for p, note in notes.items():
        print(f"# {p}: {note}")
    replayed = {p: r.describe(args.batch, args.layers, args.heads, args.kv_heads) for p, r in replay.items()}
    for p, described in replayed.items():
        share, rate = described["recorded_head_exact_share"], described["recorded_group_read_rate"]
        print(f"# {p}: {described['recorded']}; recorded layers {described['recorded_layers_replayed']}; "
              f"recorded heads exact {100 * share['replayed']:.1f}% (all layers {100 * share['all']:.1f}%); "
              f"groups read {100 * rate['replayed_regrouped']:.1f}% with the recorded paths regrouped into the "
              f"bench's groups ({100 * rate['as_recorded_all']:.1f}% in the recording's own groups)", flush=True)
    rows = run(args, replay)
    print(table(rows))
    print(summary(rows, args))
    reuse = [r["ms"] for r in rows if r["method"] == "retopk_reuse"]
    if len(reuse) > 1:
        print(f"reuse path max/min over lengths: {max(reuse) / min(reuse):.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "patterns": notes, "replay": replayed.get("replay"),
             "replay_paths": replayed.get("replay-paths"),
             "rows": rows}, indent=1))
        plot(rows, args.out.with_suffix(".png"))
    return rows


if __name__ == "__main__":
    main()
