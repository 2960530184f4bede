"""Options shared by the subcommands, and their mapping onto the SDK's arguments (in one place)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from retopk_client.addresses import DEFAULT_ADDRESS
from retopk_client.client import Client
from retopk_client.types import RETOPK_FIELDS, Method


def connection_parent(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """--address, --api-key, --timeout, with RETOPK_ADDRESS / RETOPK_API_KEY as defaults."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument("--address", default=environ.get("RETOPK_ADDRESS", DEFAULT_ADDRESS),
                   help="server address host:port (env RETOPK_ADDRESS; default %(default)s)")
    g.add_argument("--api-key", default=environ.get("RETOPK_API_KEY"),
                   help="API key, sent as 'authorization: Bearer <key>' (env RETOPK_API_KEY)")
    g.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="deadline of each call in seconds (default: none)")
    return p


def parse_value(text: str):
    """A hyperparameter value: int, float, true/false, or else the string itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(text: str) -> dict:
    """'top_k=64,tau=0.9' -> {'top_k': 64, 'tau': 0.9}."""
    params = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE[,NAME=VALUE...], got {item!r}")
        params[key.strip()] = parse_value(value.strip())
    return params


def add_method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention method")
    g.add_argument("--method", default=None,
                   help="attention method: full, exact_topk, retopk or a baseline (see 'retopk info'); "
                        "default: the server's")
    g.add_argument("--method-params", type=parse_params, default={}, metavar="K=V,...",
                   help="method hyperparameters, e.g. top_k=64,cache_size=32,window=32,recall=4,tau=0.85,"
                        "refresh_every=128 (ReTopK's K, C, W, R, tau, T_r) or a baseline's keywords")


def method_from(args: argparse.Namespace) -> Method | None:
    if args.method is None and not args.method_params:
        return None
    named = {k: v for k, v in args.method_params.items() if k in RETOPK_FIELDS}
    params = {k: v for k, v in args.method_params.items() if k not in RETOPK_FIELDS}
    return Method(name=args.method or "", **named, params=params)


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens_default: int | None = None) -> None:
    g = p.add_argument_group("sampling (absent: the server's defaults, greedy)")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens_default, metavar="N",
                   help="most tokens to generate" + (" (default %(default)s)" if max_new_tokens_default else ""))
    g.add_argument("--temperature", type=float, help="softmax temperature >= 0 (0 = greedy)")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, help="sample among the K most likely tokens (0 = off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability")
    g.add_argument("--repetition-penalty", type=float, help="> 0, 1 = off")
    g.add_argument("--presence-penalty", type=float, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, help="in [-2, 2]")
    g.add_argument("--seed", type=int, help="seed for reproducible sampling")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


SAMPLING_ARGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed")


def generate_kwargs(args: argparse.Namespace) -> dict:
    """The Client.generate keyword arguments selected by the sampling flags."""
    kwargs = {name: getattr(args, name) for name in SAMPLING_ARGS if getattr(args, name) is not None}
    if args.max_new_tokens is not None:
        kwargs["max_new_tokens"] = args.max_new_tokens
    if args.stop:
        kwargs["stop"] = args.stop
    return kwargs


def make_client(args: argparse.Namespace) -> Client:
    return Client(args.address, api_key=args.api_key, timeout=args.timeout)


def print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


def stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def is_tty(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def environ() -> Mapping[str, str]:
    """The process environment, read when the command line is parsed (never at import)."""
    return os.environ
