"""Does a NOT_FOUND tell another key's session from an id that never existed? Codes, messages, latency.

Starts a `retopk-server` on loopback with two keys (alice, bob) in a keys file, opens --sessions
sessions as alice (server-made ids), then, as bob, asks GetSession and Generate (a continuation) for
alice's real ids and for random ids of the same form, in a shuffled interleaved order, --rounds
times each. Prints, per rpc and kind of id, the status codes and messages seen (with the id written
as <id>) and the latency percentiles in microseconds. The latencies are a report, not a test: on a
busy machine they are noisy; what matters is that the distributions overlap.

    python -m bench.session_oracle --sessions 32 --rounds 2000
"""

from __future__ import annotations

import argparse
import hashlib
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc

from bench.server_scaling import start_server
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_shared.metadata import AUTHORIZATION, SESSION_METADATA


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=32, help="alice's sessions (the real ids bob probes)")
    p.add_argument("--rounds", type=int, default=2000, help="probes per rpc and kind of id")
    p.add_argument("--server-args", default="", help="extra retopk-server flags")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def probe(stub, rpc: str, sid: str, key: str) -> tuple[float, str, str]:
    md = ((AUTHORIZATION, f"Bearer {key}"), (SESSION_METADATA, sid))
    t0 = time.perf_counter()
    try:
        if rpc == "GetSession":
            stub.GetSession(pb.GetSessionRequest(session_id=sid), metadata=md, timeout=30)
        else:
            list(stub.Generate(pb.GenerateRequest(text="x", session_id=sid, max_new_tokens=1), metadata=md,
                               timeout=30))
        code, details = "OK", ""
    except grpc.RpcError as e:
        code, details = e.code().name, e.details()
    return (time.perf_counter() - t0) * 1e6, code, details.replace(sid, "<id>")


def main(argv=None) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    keys = {"alice": secrets.token_urlsafe(32), "bob": secrets.token_urlsafe(32)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "keys.txt"
        path.write_text("".join(f"{n}:{hashlib.sha256(k.encode()).hexdigest()}\n" for n, k in keys.items()))
        proc, address = start_server(f"--api-keys-file {path} --max-sessions {args.sessions + 8} {args.server_args}")
        try:
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.ReTopKServiceStub(channel)
                alice = ((AUTHORIZATION, f"Bearer {keys['alice']}"),)
                real = [stub.CreateSession(pb.CreateSessionRequest(), metadata=alice).session_id
                        for _ in range(args.sessions)]
                plan = [(rpc, kind) for rpc in ("GetSession", "Generate") for kind in ("other key's", "random")
                        for _ in range(args.rounds)]
                rng.shuffle(plan)
                for rpc in ("GetSession", "Generate"):  # warm-up
                    probe(stub, rpc, real[0], keys["bob"])
                results: dict[tuple[str, str], list] = {}
                for rpc, kind in plan:
                    sid = rng.choice(real) if kind == "other key's" else secrets.token_hex(16)
                    results.setdefault((rpc, kind), []).append(probe(stub, rpc, sid, keys["bob"]))
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"{'rpc':<11} {'id':<12} {'n':>5} {'p10 us':>8} {'p50 us':>8} {'p90 us':>8}  status (message)")
    for (rpc, kind), rows in sorted(results.items()):
        lat = sorted(r[0] for r in rows)
        q = statistics.quantiles(lat, n=10)
        statuses = Counter(f"{c} ({d})" for _, c, d in rows)
        print(f"{rpc:<11} {kind:<12} {len(rows):>5} {q[0]:>8.0f} {statistics.median(lat):>8.0f} {q[-1]:>8.0f}  "
              + "; ".join(f"{s} x{n}" for s, n in statuses.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
