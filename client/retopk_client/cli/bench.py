"""`retopk bench`: load a running server with N concurrent streams and report throughput and latency.

Only loopback targets are allowed unless --allow-remote is given. See retopk_client.loadgen for
how TTFT, inter-token latency and throughput are measured.
"""

from __future__ import annotations

import argparse

from retopk_client.cli import common
from retopk_client.loadgen import DEFAULT_PROMPT, BenchConfig, run_bench


def register(sub, parents) -> None:
    p = sub.add_parser(
        "bench", parents=parents, help="load generator: N concurrent streams, throughput and latency percentiles",
        description="Open N concurrent Generate streams against a running server for a fixed duration or request "
                    "count; report throughput (tokens/s), TTFT and inter-token latency p50/p90/p99 and errors by "
                    "gRPC code. Targets loopback addresses only unless --allow-remote is given.",
    )
    p.add_argument("-n", "--concurrency", type=int, default=8, help="concurrent streams (default %(default)s)")
    stop = p.add_mutually_exclusive_group()
    stop.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                      help="send requests for this long (in-flight ones finish)")
    stop.add_argument("--requests", type=int, default=None, metavar="N",
                      help="send this many requests in all (default: 4 x concurrency when --duration is absent)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt of every request")
    p.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at end-of-sequence tokens (default: generate exactly --max-new-tokens)")
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --address")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--logprobs", type=int, nargs="?", const=0, default=None, metavar="N",
                   help="ask for each token's log-probability (and N alternatives); the report adds their mean")
    common.add_sampling_args(p, max_new_tokens_default=64)
    common.add_method_args(p)
    p.set_defaults(run=run)


def config_from(args: argparse.Namespace) -> BenchConfig:
    kwargs = common.generate_kwargs(args)
    max_new_tokens = kwargs.pop("max_new_tokens")
    method = common.method_from(args)
    if method is not None:
        kwargs["method"] = method
    if args.logprobs is not None:
        kwargs["logprobs"], kwargs["top_logprobs"] = True, args.logprobs
    requests = args.requests
    if args.duration is None and requests is None:
        requests = 4 * args.concurrency
    return BenchConfig(
        address=args.address, concurrency=args.concurrency, duration=args.duration, requests=requests,
        prompt=args.prompt, chat=not args.raw, max_new_tokens=max_new_tokens, ignore_eos=args.ignore_eos,
        api_key=args.api_key, timeout=args.timeout, allow_remote=args.allow_remote, generate_kwargs=kwargs,
        tls=args.tls, ca=args.ca, cert=args.cert, key=args.key,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as err:
        common.stderr(f"retopk bench: error: {err}")
        return 2
    report = run_bench(config)
    if args.json:
        common.print_json(report.to_dict())
    else:
        print(report.format_table())
    return 0 if report.requests_ok > 0 else 1
