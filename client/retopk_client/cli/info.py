"""`retopk info`, `retopk status` and `retopk health`: what the server serves, its load, and whether it is up."""

from __future__ import annotations

import argparse

from retopk_client.cli import common
from retopk_shared.service_names import SERVICE_NAME


def register(sub, parents) -> None:
    info = sub.add_parser("info", parents=parents, help="describe the served model, methods and limits",
                          description="Describe the served model, its default attention method, the available "
                                      "methods and the server's limits.")
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(run=run_info)
    status = sub.add_parser("status", parents=parents, help="the server's current load",
                            description="Running and queued requests, sessions, KV memory, draining.")
    status.add_argument("--json", action="store_true", help="print a JSON object")
    status.set_defaults(run=run_status)
    health = sub.add_parser("health", parents=parents, help="standard gRPC health check (exit 0 when SERVING)",
                            description="Ask grpc.health.v1.Health/Check; prints the status and exits 0 when "
                                        "it is SERVING, 1 otherwise.")
    health.add_argument("--service", default="",
                        help=f"service to check ('' = the whole server, or {SERVICE_NAME})")
    health.add_argument("--json", action="store_true", help="print a JSON object")
    health.set_defaults(run=run_health)


def run_info(args: argparse.Namespace) -> int:
    with common.make_client(args) as client:
        m = client.model_info()
    if args.json:
        common.print_json(m.to_dict())
        return 0
    lim = m.limits
    print("\n".join([
        f"model           {m.name} ({m.architecture})",
        f"shape           {m.num_layers} layers, {m.num_heads} heads, {m.num_kv_heads} kv heads, head dim {m.head_dim}",
        f"context         {m.max_context} tokens, vocabulary {m.vocab_size}",
        f"device          {m.device}, attention backend {m.backend}",
        f"weights         {m.weight_format} ({m.weight_bytes / 1e6:.1f} MB read per decode step), "
        f"KV cache {m.kv_dtype}, residual stream {m.dtype}",
        f"default method  {m.default_method.describe()}",
        f"methods         {', '.join(m.methods)}",
        f"sampling        {_sampling(m.default_sampling)} for unset fields ({m.default_sampling_source})",
        *_limits(lim),
        f"server version  {m.server_version}",
    ]))
    return 0


def _limits(limits) -> list[str]:
    """Every limit the server reports (all the fields of Limits, which are the proto's), a few per line."""
    items = [f"{name} {value}" for name, value in limits.to_dict().items()]
    lines = [", ".join(items[i:i + 4]) for i in range(0, len(items), 4)]
    return [f"{'limits' if i == 0 else '':<16}{line}" for i, line in enumerate(lines)]


def _sampling(sampling) -> str:
    return ", ".join(f"{k}={v}" for k, v in sampling.to_dict().items() if v is not None) or "none reported"


def run_status(args: argparse.Namespace) -> int:
    with common.make_client(args) as client:
        s = client.server_status()
    if args.json:
        common.print_json(s.to_dict())
    else:
        print(f"running {s.running}, queued {s.queued}, sessions {s.sessions} (+{s.ephemeral_sessions} ephemeral), "
              f"kv {s.kv_bytes / 2**20:.2f} MiB{', DRAINING' if s.draining else ''}")
    return 0


def run_health(args: argparse.Namespace) -> int:
    with common.make_client(args) as client:
        status = client.health(args.service)
    if args.json:
        common.print_json({"service": args.service, "status": status})
    else:
        print(status)
    return 0 if status == "SERVING" else 1
