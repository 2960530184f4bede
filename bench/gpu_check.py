"""One prepared GPU check: the kernel tests compiled for real, then attention latency per token.

    python bench/gpu_check.py                    # on a GPU machine (stops starting new points at --budget-s)
    python bench/gpu_check.py --interpret --tiny # end to end on the CPU under TRITON_INTERPRET
    PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --out-dir "$OUT"   # on the lent H200 box: B = 1 and 8

Stage 1 runs ``pytest tests/core/kernels`` compiled (one process per test file, in parallel) and, beside
them, one warm-up process per method that compiles the benchmark's kernels into triton's disk cache
(the large bitonic networks take tens of seconds each to compile; in parallel this hides). Stage 2 times
one attention layer's decode step (``method.decode`` with ``backend="triton"``) for Full attention,
Exact Top-K and ReTopK on the same KV cache, Qwen2.5-7B shapes by default (28 query heads, 4 KV
heads, head dim 128, bf16, K = 512), at 16K-128K tokens, B = 1 and 8.

ReTopK runs three ways. Its path mix is set by the queries: each head has a few anchor directions;
on a step, a head draws one of its anchors (cosine 1 with a cached query -> reuse) with probability
``--reuse-share`` (the paper's ~88%), otherwise a fresh random direction (cosine ~0 -> fallback):
    reuse   every head draws an anchor: the reuse path alone (selector, indexed QK, select + attend)
    mix     the drawn per-head mix under the paper's per-head rule (gqa_policy "head")
    group   the same queries under the "group" GQA policy (one decision per KV group, mean ρ_max)
The FIFOs are filled by warm-up steps first; refresh is disabled so the mix is exactly the drawn one,
and the measured reuse share and group-read share (KV groups whose keys were read in full) are
reported. Timing: torch.cuda.Event around ``--iters`` steps after
``--warmup`` steps (perf_counter on the CPU). Per-token numbers multiply one layer by ``--layers``.
Results: a table on stdout with ratios against Exact Top-K, and results/gpu_check_<date>.{md,json}.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path as FsPath

STARTED = time.perf_counter()
ROOT = FsPath(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a plain script from a checkout that is not pip-installed (the GPU box)
    sys.path.insert(0, str(ROOT))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="run the kernels under TRITON_INTERPRET on the CPU")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and few iterations (with --interpret)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="context lengths (default 16K..128K)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--heads", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--top-k", type=int, default=512)
    p.add_argument("--cache-size", type=int, default=32)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--recall", type=int, default=4)
    p.add_argument("--tau", type=float, default=0.85)
    p.add_argument("--reuse-share", type=float, default=0.88)
    p.add_argument("--layers", type=int, default=28, help="layers per token (Qwen2.5-7B: 28)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--tests-timeout", type=int, default=300)
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="no new (B, L) point starts after this many seconds from the start (written as skipped): "
                        "the whole command stays within about 8 minutes on an H200")
    p.add_argument("--out-dir", type=FsPath, default=ROOT / "results")
    p.add_argument("--warm-only", choices=["full", "exact", "retopk", "retopk_group"], default=None,
                   help="internal: compile one method's kernels at the first length and exit")
    args = p.parse_args(argv)
    if args.tiny:
        args.heads, args.kv_heads, args.head_dim = 4, 2, 64
        args.top_k, args.cache_size, args.window, args.recall = 16, 8, 8, 2
        args.lengths = args.lengths or [256, 512]
        args.warmup = 2 if args.warmup is None else args.warmup
        args.iters = 2 if args.iters is None else args.iters
    args.lengths = args.lengths or [16384, 32768, 65536, 131072]
    args.warmup = 10 if args.warmup is None else args.warmup
    args.iters = 30 if args.iters is None else args.iters
    if not 0.0 <= args.reuse_share <= 1.0:
        p.error("--reuse-share must lie in [0, 1]")
    return args


def run_tests(args) -> dict:
    """pytest tests/core/kernels, one process per test file in parallel (each compiles its own kernel
    variants; triton's disk cache is shared), and on a GPU, alongside them, one warm-up process per
    method that compiles the benchmark's kernels. The tiny mode runs one fast file only."""
    import concurrent.futures as cf

    env = dict(os.environ)
    if args.interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    if args.tiny:
        files = ["tests/core/kernels/test_bitonic.py"]
    else:  # the test that runs this script itself under the interpreter is left out
        files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "core" / "kernels").glob("test_*.py")
                       if p.name != "test_gpu_check_script.py")
    jobs = {f: [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f] for f in files}
    if not args.interpret:
        common = ["--skip-tests", "--lengths", str(min(args.lengths)), "--batch", str(args.batch[0]),
                  *sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in
                        ("heads", "kv_heads", "head_dim", "top_k", "cache_size", "window", "recall", "tau")), [])]
        for m in ("full", "exact", "retopk", "retopk_group"):
            jobs[f"warm:{m}"] = [sys.executable, str(FsPath(__file__).resolve()), "--warm-only", m, *common]

    def run(cmd):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.tests_timeout)
            lines = (p.stdout + p.stderr).strip().splitlines()
            return p.returncode, (lines[-1] if lines else ""), p.stdout + p.stderr, time.perf_counter() - t0
        except subprocess.TimeoutExpired:
            return -1, f"timed out after {args.tests_timeout} s", "", time.perf_counter() - t0

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        results = dict(zip(jobs, pool.map(run, jobs.values()), strict=True))
    report = {"files": {}, "warm": {}}
    for name, (rc, last, out, secs) in results.items():
        kind = "warm" if name.startswith("warm:") else "files"
        report[kind][name.removeprefix("warm:")] = {"returncode": rc, "summary": last, "seconds": round(secs, 1)}
        print(f"[{'warm ' if kind == 'warm' else 'tests'}] {name}: rc={rc} {last} ({secs:.0f} s)", flush=True)
        if rc != 0:
            print(out[-4000:], flush=True)
    rcs = [r["returncode"] for r in report["files"].values()]
    report.update(target=files, returncode=max(rcs, key=abs) if any(rcs) else 0,
                  summary="; ".join(f"{FsPath(f).name}: {r['summary']}" for f, r in report["files"].items()),
                  seconds=round(time.perf_counter() - t0, 1))
    return report


class Timer:
    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"

    def __call__(self, fn, warmup: int, iters: int) -> float:
        """Mean milliseconds per call of fn after warmup calls."""
        for _ in range(warmup):
            fn()
        if self.cuda:
            self.torch.cuda.synchronize()
            start, end = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters


RETOPK_VARIANTS = ("reuse", "mix", "group")


def make_case(args, B: int, L: int, device, dtype) -> dict:
    """KV cache, query pools and the methods for one (B, L) point (ReTopK: one method and state per variant)."""
    import torch

    from retopk_core.kv import PagedKV
    from retopk_core.methods import make_method

    H, H_kv, d = args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator(device=device).manual_seed(L + B)
    k = torch.randn(B, H_kv, L, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, H_kv, L, d, device=device, dtype=dtype, generator=gen)
    # queries: per head A anchors (reuse) or a fresh direction (fallback); a pool cycled by the steps
    A, pool = 4, 16
    anchors = torch.randn(B, H, A, d, device=device, generator=gen)
    draw = torch.randint(0, A, (pool, B, H, 1, 1), device=device, generator=gen)
    use_anchor = torch.rand(pool, B, H, 1, device=device, generator=gen) < args.reuse_share
    fresh = torch.randn(pool, B, H, d, device=device, generator=gen)
    picked = anchors.unsqueeze(0).expand(pool, B, H, A, d).gather(3, draw.expand(pool, B, H, 1, d)).squeeze(3)
    mixed = (torch.where(use_anchor, picked, fresh) * 3.0).to(dtype)  # (pool, B, H, d)
    params = dict(top_k=args.top_k, cache_size=args.cache_size, window=args.window, recall=args.recall,
                  tau=args.tau, refresh_every=0)
    retopk = {"reuse": make_method("retopk", backend="triton", **params),
              "mix": make_method("retopk", backend="triton", **params),
              "group": make_method("retopk", backend="triton", gqa_policy="group", **params)}
    states = {}
    for name, method in retopk.items():
        states[name] = method.init_state(H, H_kv, d, device=device, capacity=B)
        for _ in range(B):
            states[name].alloc()
    full = make_method("full", backend="triton")
    return {"kv": PagedKV.contiguous(k, v), "slots": torch.arange(B, device=device),
            "qs": {"reuse": (picked * 3.0).to(dtype), "mix": mixed, "group": mixed},
            "warm_q": (anchors.permute(2, 0, 1, 3) * 3.0).to(dtype),  # (A, B, H, d): fills every FIFO
            "full": full, "exact": make_method("exact_topk", top_k=args.top_k, backend="triton"),
            "retopk": retopk, "states": states, "none": full.init_state(H, H_kv, d, device=device, capacity=B)}


def warm_only(args, method: str, device, dtype) -> None:
    """Compile one method's kernels (run in parallel processes; triton's disk cache keeps them)."""
    c = make_case(args, args.batch[0], min(args.lengths), device, dtype)
    if method.startswith("retopk"):
        variant = "group" if method == "retopk_group" else "mix"
        for q in c["warm_q"]:  # the first step falls back (exact kernels), the next ones reuse
            c["retopk"][variant].decode(q, c["kv"], c["states"][variant], c["slots"])
    else:
        c[method].decode(c["qs"]["mix"][0], c["kv"], c["none"], c["slots"])
    import torch

    torch.cuda.synchronize()


def bench_one(args, B: int, L: int, device, dtype) -> dict:
    import torch

    from retopk_core.methods import Path
    from retopk_core.methods.base import group_reads

    c = make_case(args, B, L, device, dtype)
    kv, slots, none = c["kv"], c["slots"], c["none"]
    timer = Timer(device)
    row = {"B": B, "L": L}
    step = {"i": 0}

    def next_q(variant="mix"):
        qs = c["qs"][variant]
        step["i"] += 1
        return qs[step["i"] % qs.shape[0]]

    row["full_ms"] = timer(lambda: c["full"].decode(next_q(), kv, none, slots), args.warmup, args.iters)
    row["exact_ms"] = timer(lambda: c["exact"].decode(next_q(), kv, none, slots), args.warmup, args.iters)
    for variant in RETOPK_VARIANTS:
        method, state, paths = c["retopk"][variant], c["states"][variant], []
        for q in c["warm_q"]:  # fill the FIFOs: the first step falls back (empty cache), later anchors reuse
            method.decode(q, kv, state, slots)

        def retopk_step(method=method, state=state, paths=paths, variant=variant):
            paths.append(method.decode(next_q(variant), kv, state, slots).path)

        ms = timer(retopk_step, args.warmup, args.iters)
        allp = torch.stack(paths[args.warmup:])  # (iters, B, H)
        row[f"retopk_{variant}_ms"] = ms
        row[f"retopk_{variant}_reuse_share"] = float((allp == Path.REUSE).float().mean())
        row[f"retopk_{variant}_group_read_share"] = float(group_reads(allp, args.kv_heads).float().mean())
        row[f"retopk_{variant}_vs_exact"] = row["exact_ms"] / ms
    # the per-head mix keeps the historical column names
    row["retopk_ms"], row["reuse_share"] = row["retopk_mix_ms"], row["retopk_mix_reuse_share"]
    row["fallback_share"] = 1.0 - row["reuse_share"]
    for m in ("full", "exact", "retopk", *(f"retopk_{v}" for v in RETOPK_VARIANTS)):
        row[f"{m}_ms_per_token"] = row[f"{m}_ms"] * args.layers
    row["full_vs_exact"] = row["exact_ms"] / row["full_ms"]
    row["retopk_vs_exact"] = row["exact_ms"] / row["retopk_ms"]
    print(f"[bench] B={B} L={L}: full {row['full_ms']:.3f} ms, exact {row['exact_ms']:.3f} ms, retopk "
          + ", ".join(f"{v} {row[f'retopk_{v}_ms']:.3f} ms (reuse {row[f'retopk_{v}_reuse_share']:.1%}, "
                      f"group reads {row[f'retopk_{v}_group_read_share']:.1%})" for v in RETOPK_VARIANTS), flush=True)
    return row


def render(meta: dict, rows: list[dict], tests: dict | None) -> str:
    lines = [f"# GPU check {meta['date']}", "",
             f"- device: {meta['device']}", f"- mode: {meta['mode']}",
             f"- torch {meta['torch']}, triton {meta['triton']}",
             f"- shapes: H={meta['heads']} H_kv={meta['kv_heads']} d={meta['head_dim']} K={meta['top_k']} "
             f"C={meta['cache_size']} W={meta['window']} R={meta['recall']} tau={meta['tau']} dtype={meta['dtype']}",
             f"- per-token = one layer x {meta['layers']} layers; speedup = Exact Top-K time / method time", ""]
    if meta["mode"] == "interpret":
        lines += ["- INTERPRETER RUN: timings measure the Python interpreter, not GPU kernels; no speed claim", ""]
    if tests is not None:
        lines += [f"- kernel tests (rc={tests['returncode']}, {tests['seconds']} s, one process per file): "
                  f"{tests['summary']}", ""]
    lines += ["| B | L | Full ms/tok | Exact Top-K ms/tok | ReTopK reuse ms/tok | ReTopK mix ms/tok | "
              "ReTopK group ms/tok | Full speedup | reuse speedup | mix speedup | group speedup | "
              "mix reuse / group reads | group reuse / group reads |", "|" + "---|" * 13]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['B']} | {r['L']} | skipped: {r['skipped']} |" + " |" * 10)
            continue
        lines.append(f"| {r['B']} | {r['L']} | {r['full_ms_per_token']:.3f} | {r['exact_ms_per_token']:.3f} | "
                     + " | ".join(f"{r[f'retopk_{v}_ms_per_token']:.3f}" for v in RETOPK_VARIANTS)
                     + f" | {r['full_vs_exact']:.2f}x | "
                     + " | ".join(f"{r[f'retopk_{v}_vs_exact']:.2f}x" for v in RETOPK_VARIANTS)
                     + "".join(f" | {r[f'retopk_{v}_reuse_share']:.1%} / {r[f'retopk_{v}_group_read_share']:.1%}"
                               for v in ("mix", "group")) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import torch

    if not args.interpret and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or use --interpret --tiny on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.interpret else "cuda")
    dtype = torch.float32 if args.interpret else torch.bfloat16  # the interpreter has no bf16 dot
    if args.warm_only:
        with torch.inference_mode():
            warm_only(args, args.warm_only, device, dtype)
        return 0
    tests = None if args.skip_tests else run_tests(args)
    import triton

    now = dt.datetime.now(dt.UTC)
    meta = {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "mode": "interpret" if args.interpret else "compiled",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor()})",
            "torch": torch.__version__, "triton": triton.__version__, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "top_k": args.top_k, "cache_size": args.cache_size, "window": args.window,
            "recall": args.recall, "tau": args.tau, "reuse_share_target": args.reuse_share,
            "dtype": str(dtype).removeprefix("torch."), "layers": args.layers, "warmup": args.warmup,
            "iters": args.iters, "budget_s": args.budget_s, "retopk_variants": list(RETOPK_VARIANTS)}
    rows = []
    with torch.inference_mode():
        for B in args.batch:
            for L in args.lengths:
                spent = time.perf_counter() - STARTED
                if spent > args.budget_s:  # keep the command within its budget; say what was left out
                    print(f"[bench] B={B} L={L}: skipped ({spent:.0f} s > --budget-s {args.budget_s:.0f})", flush=True)
                    rows.append({"B": B, "L": L, "skipped": f"budget ({spent:.0f} s spent)"})
                    continue
                rows.append(bench_one(args, B, L, device, dtype))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    table = render(meta, rows, tests)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{now.strftime('%Y-%m-%d')}" + ("_interpret" if args.interpret else "")
    (args.out_dir / f"{stem}.md").write_text(table)
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "tests": tests, "rows": rows}, indent=2))
    print(f"wrote {args.out_dir / stem}.md and .json")
    return 0 if tests is None or tests["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
