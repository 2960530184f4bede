"""Server throughput under concurrent streams: does continuous batching pay off?

Starts a `retopk-server` on loopback (or uses --address), then runs the client's load generator
(`retopk bench`'s engine, retopk_client.loadgen) at each concurrency level with the same prompt and
length, and prints tokens/s, the ratio to one stream, TTFT and inter-token latency percentiles.
Sampling is greedy (temperature 0, --temperature to change it) so that runs compare with one another
and with the recorded results, whatever the server's default sampling.

It prints this client process's CPU time per generated token (all its threads: the SDK, gRPC, the load
generator), what the client takes from the cores the server shares on one machine. With a server it starts, it
also prints the server process's CPU time (all its threads, from Linux's /proc)
per generated token at each level and the ratio of tokens per CPU-second to the first level's: what a
loaded machine's other work inflates less than tokens/s, which is wall time. With one thread for the
model (``--server-args "--threads 1"``) that ratio is what the streams gain on one core.

    python bench/server_scaling.py --concurrency 1 2 4 8 --max-new-tokens 32
    python -m bench.server_scaling --concurrency 1 8 --server-args "--threads 1"   # on a loaded machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path as FsPath

from retopk_client import Client
from retopk_client.errors import RetopkError
from retopk_client.loadgen import BenchConfig, run_bench


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default=None, help="a running server (default: start one on loopback)")
    p.add_argument("--server-args", default="", help='extra retopk-server flags, e.g. "--method full"')
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--requests-per-stream", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--prompt", default="Write a short story about a lighthouse keeper who finds a message.")
    p.add_argument("--out", type=FsPath, default=None, help="write <out>.json and <out>.png")
    return p.parse_args(argv)


def start_server(extra: str, timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    """`retopk-server` on 127.0.0.1 with a kernel-chosen port; returns (process, "127.0.0.1:PORT")."""
    cmd = [sys.executable, "-m", "retopk_server.cli", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
           *extra.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            m = re.search(r"listening on \S+:(\d+)", line)
            if m and not found:
                found.append(f"127.0.0.1:{m.group(1)}")

    threading.Thread(target=read, daemon=True).start()

    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("retopk-server did not start")
        time.sleep(0.2)
    with Client(found[0]) as client:  # "listening" may come before the model is loaded: wait for SERVING
        while True:
            try:
                if client.health() == "SERVING":
                    break
            except RetopkError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit("retopk-server did not become SERVING")
            time.sleep(0.5)
    return proc, found[0]


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far, all its threads (Linux's /proc), or None where there is
    no /proc."""
    try:
        fields = FsPath(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # from field 3, the state
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # fields 14, 15: utime, stime


def run(address: str, args, pid: int | None = None) -> list[dict]:
    """One load per concurrency level -> its report's dict, with this client process's CPU seconds over the level
    (``client_cpu_s``, all its threads) and per generated token (``client_cpu_ms_per_token``); with the server's
    ``pid``, also the server's (``server_cpu_s``, ``server_cpu_ms_per_token``)."""
    rows = []
    for n in args.concurrency:
        cpu = process_cpu_seconds(pid) if pid is not None else None
        client_cpu = time.process_time()
        report = run_bench(BenchConfig(address=address, concurrency=n, requests=n * args.requests_per_stream,
                                       prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                                       generate_kwargs={"temperature": args.temperature}))
        client_cpu = time.process_time() - client_cpu
        row = report.to_dict()
        row["client_cpu_s"] = client_cpu
        row["client_cpu_ms_per_token"] = 1e3 * client_cpu / max(1, row["generated_tokens"])
        if cpu is not None:
            row["server_cpu_s"] = process_cpu_seconds(pid) - cpu
            row["server_cpu_ms_per_token"] = 1e3 * row["server_cpu_s"] / max(1, row["generated_tokens"])
        rows.append(row)
        used = f", server CPU {row['server_cpu_ms_per_token']:.2f} ms a token" if cpu is not None else ""
        used += f", client CPU {row['client_cpu_ms_per_token']:.2f} ms a token"
        print(f"concurrency {n}: {row['tokens_per_second']:.1f} tokens/s{used}", flush=True)
    base = rows[0]["tokens_per_second"]
    for r in rows:
        r["vs_first"] = r["tokens_per_second"] / base if base else float("nan")
        if "server_cpu_ms_per_token" in r:  # tokens per CPU-second against the first level's
            r["cpu_vs_first"] = rows[0]["server_cpu_ms_per_token"] / r["server_cpu_ms_per_token"]
    return rows


def table(rows: list[dict]) -> str:
    cpu = "server_cpu_ms_per_token" in rows[0]
    lines = ["| streams | tokens/s | vs 1st row | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p90 ms | ITL p99 ms "
             "| errors |" + (" server CPU ms/token | tokens/CPU-s vs 1st |" if cpu else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if cpu else "")]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['tokens_per_second']:.1f} | {r['vs_first']:.2f}x | "
                     f"{r['ttft']['p50_ms']:.0f} | {r['ttft']['p99_ms']:.0f} | {r['itl']['p50_ms']:.0f} | "
                     f"{r['itl']['p90_ms']:.0f} | {r['itl']['p99_ms']:.0f} | {r['requests_failed']} |"
                     + (f" {r['server_cpu_ms_per_token']:.1f} | {r['cpu_vs_first']:.2f}x |" if cpu else ""))
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    proc = None
    address = args.address
    if address is None:
        proc, address = start_server(args.server_args)
    try:
        rows = run(address, args, proc.pid if proc is not None else None)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_second"] for r in rows], marker="o")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("aggregate tokens/s")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=120)
    return rows


if __name__ == "__main__":
    main()
