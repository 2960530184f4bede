"""Options shared by the subcommands, and their mapping onto the SDK's arguments (in one place)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from retopk_client.addresses import DEFAULT_ADDRESS
from retopk_client.client import Client
from retopk_client.types import SAMPLING_FIELDS, Method
from retopk_shared.fields import RETOPK_FIELDS
from retopk_shared.name_value import parse_params


def add_connection_args(p: argparse.ArgumentParser, environ: Mapping[str, str], suppress: bool = False) -> None:
    """--address, --api-key, --timeout, --tls, --ca, --cert, --key, with RETOPK_ADDRESS / RETOPK_API_KEY /
    RETOPK_TLS / RETOPK_TLS_CA / RETOPK_TLS_CLIENT_CERT / RETOPK_TLS_CLIENT_KEY as defaults.

    Both the top-level parser and each subcommand take them, so they go before or after the subcommand;
    the subcommand's copy is ``suppress``ed (absent from the namespace unless given), so that it does
    not overwrite a value given before the subcommand with its default.
    """
    defaults = {"address": environ.get("RETOPK_ADDRESS", DEFAULT_ADDRESS), "api_key": environ.get("RETOPK_API_KEY"),
                "timeout": None,
                "tls": environ.get("RETOPK_TLS", "").strip().lower() in ("1", "true", "yes", "on"),
                "ca": environ.get("RETOPK_TLS_CA"), "cert": environ.get("RETOPK_TLS_CLIENT_CERT"),
                "key": environ.get("RETOPK_TLS_CLIENT_KEY")}

    def default(name):
        return argparse.SUPPRESS if suppress else defaults[name]

    g = p.add_argument_group("connection")
    g.add_argument("--address", default=default("address"),
                   help=f"server address host:port (env RETOPK_ADDRESS; default {defaults['address']})")
    g.add_argument("--api-key", default=default("api_key"),
                   help="API key, sent as 'authorization: Bearer <key>' (env RETOPK_API_KEY)")
    g.add_argument("--timeout", type=float, default=default("timeout"), metavar="SECONDS",
                   help="deadline of each call in seconds (default: none)")
    g.add_argument("--tls", action="store_true", default=default("tls"),
                   help="connect over TLS, trusting --ca or the system's roots (env RETOPK_TLS=1)")
    g.add_argument("--ca", default=default("ca"), metavar="PEM",
                   help="CA certificate(s) the server's certificate is checked against; implies --tls "
                        "(env RETOPK_TLS_CA)")
    g.add_argument("--cert", default=default("cert"), metavar="PEM",
                   help="client certificate chain for mutual TLS, with --key; implies --tls "
                        "(env RETOPK_TLS_CLIENT_CERT)")
    g.add_argument("--key", default=default("key"), metavar="PEM",
                   help="private key of --cert (env RETOPK_TLS_CLIENT_KEY)")


def connection_parent(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The connection options of a subcommand (see ``add_connection_args``)."""
    p = argparse.ArgumentParser(add_help=False)
    add_connection_args(p, environ, suppress=True)
    return p


def method_params_arg(text: str) -> dict:
    """``--method-params`` in the shared NAME=VALUE grammar (retopk_shared.name_value), as an argparse type."""
    try:
        return parse_params(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_method_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("attention method")
    g.add_argument("--method", default=None,
                   help="attention method: full, exact_topk, retopk or a baseline (see 'retopk info'); "
                        "default: the server's")
    g.add_argument("--method-params", type=method_params_arg, default={}, metavar="K=V,...",
                   help="method hyperparameters, e.g. top_k=64,cache_size=32,window=32,recall=4,tau=0.85,"
                        "refresh_every=128 (ReTopK's K, C, W, R, tau, T_r) or a baseline's keywords")


def method_from(args: argparse.Namespace) -> Method | None:
    if args.method is None and not args.method_params:
        return None
    named = {k: v for k, v in args.method_params.items() if k in RETOPK_FIELDS}
    params = {k: v for k, v in args.method_params.items() if k not in RETOPK_FIELDS}
    return Method(name=args.method or "", **named, params=params)


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens_default: int | None = None) -> None:
    g = p.add_argument_group("sampling (absent: the server's defaults, see 'retopk info'; --temperature 0 is greedy)")
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


def generate_kwargs(args: argparse.Namespace) -> dict:
    """The Client.generate keyword arguments selected by the sampling flags."""
    kwargs = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    if args.max_new_tokens is not None:
        kwargs["max_new_tokens"] = args.max_new_tokens
    if args.stop:
        kwargs["stop"] = args.stop
    return kwargs


def make_client(args: argparse.Namespace) -> Client:
    return Client(args.address, api_key=args.api_key, timeout=args.timeout, tls=args.tls, ca=args.ca,
                  cert=args.cert, key=args.key)


def print_json(obj) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


def stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def is_tty(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty()


def environ() -> Mapping[str, str]:
    """The process environment, read when the command line is parsed (never at import)."""
    return os.environ
