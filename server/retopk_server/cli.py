"""`retopk-server`: start the gRPC decoding server; `retopk-server hash-key NAME`: a keys-file line.

Every ServerConfig field has one command-line flag and one RETOPK_* environment variable, listed
once in OPTIONS below. Flags override the environment; the environment overrides the defaults.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.retopk_config import ReTopKConfig  # torch-free, as the huge pages ask
from retopk_shared.name_value import format_params, parse_params, parse_value  # the one NAME=VALUE grammar

__all__ = ["OPTIONS", "build_parser", "config_from", "main", "parse_params", "parse_rope_scaling", "parse_value"]

if TYPE_CHECKING:  # imported where used: it imports torch, which main() must precede (huge pages)
    from retopk_server.config import ServerConfig


def parse_optional_int(text: str) -> int | None:
    """An integer, or None for "" / "none" / "auto"."""
    return None if text.strip().lower() in ("", "none", "auto") else int(text)


def parse_optional_float(text: str) -> float | None:
    """A number, or None for "" / "none"."""
    return None if text.strip().lower() in ("", "none") else float(text)


_BYTE_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
               "t": 10 ** 12, "tb": 10 ** 12, "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_optional_bytes(text: str) -> int | None:
    """A byte count with an optional unit ("8GiB", "512MB", "1e9"), or None for "" / "none" / "auto"."""
    t = text.strip().lower().replace(" ", "")
    if t in ("", "none", "auto"):
        return None
    number = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(number):]
    if unit not in _BYTE_UNITS or not number:
        raise ValueError(f"expected a byte count such as 8GiB, 512MB or 1000000000, got {text!r}")
    return int(float(number) * _BYTE_UNITS[unit])


def parse_optional_str(text: str) -> str | None:
    return text or None


def parse_bool(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case)."""
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def parse_rope_scaling(text: str) -> dict | None:
    """"linear:4" or "rope_type=linear,factor=4" -> {"rope_type": "linear", "factor": 4.0}; "" / "none" -> None."""
    if text.strip().lower() in ("", "none"):
        return None
    if ":" in text and "=" not in text:
        kind, _, factor = text.partition(":")
        return {"rope_type": kind.strip(), "factor": float(factor)}
    params = parse_params(text)
    if "factor" in params:
        params["factor"] = float(params["factor"])
    return params


@dataclass(frozen=True)
class Option:
    field: str
    parse: Callable[[str], object]
    help: str
    metavar: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "RETOPK_" + self.field.upper()


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "address to listen on"),
    Option("port", int, "gRPC port (0 = any free port; the chosen one is printed)"),
    Option("metrics_port", int, "Prometheus metrics port (0 = no exporter)"),
    Option("http_port", parse_optional_int, "port of the OpenAI-compatible HTTP front (/v1/completions, "
                                            "/v1/chat/completions, /v1/models, /health; none = off, "
                                            "0 = any free port)", "PORT"),
    Option("metrics_per_head", parse_bool, "export the per-head metrics (decisions per layer x head, candidates, "
                                           "similarity, attention time); false spares a GPU a synchronisation "
                                           "per layer and step", "BOOL"),
    Option("model", str, "embedded model name (smollm2-135m) or a local transformers checkpoint directory"),
    Option("device", str, "torch device: cpu, cuda, cuda:1, ..."),
    Option("weights", str, "matmul weight format: auto (as-stored on a CPU, bfloat16 on CUDA), as-stored (a GGUF "
                           "file's Q4_0/Q4_1 as int4, Q8_0 as int8; a checkpoint's own dtype), float32, bfloat16, "
                           "float16, int8 or int4 (weight-only, blocks of 32)"),
    Option("kv_dtype", str, "KV cache dtype: auto (float16 on a CPU, bfloat16 on CUDA), float32 (also float32 "
                            "prefill matmuls: no 16-bit rounding anywhere), bfloat16 or float16 (beyond ±65504 "
                            "saturated)"),
    Option("activations", str, "what the block weights' decode products multiply them with: auto (bf16x2 on a "
                               "CPU with AMX-BF16 serving int4 / int8 / as-stored GGUF weights, int16 on one with "
                               "AVX-512 VNNI but no AMX, else float32), "
                               "float32 (x as it is), int8 (x quantized per block of 32 with one scale, llama.cpp's "
                               "way, and integer block dots), bf16x2 (x as two bf16 limbs, about 16 bits of x, on "
                               "AMX tiles, CPUs with AMX-BF16 only) or int16 (x quantized per block of 32 to int16, "
                               "2^-16 of the block's largest |x|, and exact integer block dots: AVX-512 VNNI's "
                               "dpwssd where there is one); int8, bf16x2 and int16: CPU and block weights only"),
    Option("backend", str, "attention backend: auto (ReTopK's fused CPU kernel on a CPU where built, else torch), "
                           "torch (reference code), triton (GPU) or cpu"),
    Option("threads", parse_optional_int, "threads of the model's CPU work (none = the CPUs this process may use: "
                                          "its affinity, capped by a container's CPU quota; torch's own choice "
                                          "when OMP_NUM_THREADS is set)", "N"),
    Option("method", str, "default attention method: full, exact_topk, retopk or a baseline "
                          "(changing it without --method-params starts from that method's own defaults)"),
    Option("method_params", parse_params, "default method's hyperparameters NAME=VALUE,... (ReTopK's: "
                                          f"{', '.join(ReTopKConfig.names())}; a baseline's: its config fields)",
           "K=V,..."),
    Option("max_context", parse_optional_int, "longest session context in tokens (none = the model's)", "N"),
    Option("rope_scaling", parse_rope_scaling, "extend the context past the model's trained positions by RoPE "
                                               "scaling, e.g. linear:4 (4x the positions) or "
                                               "rope_type=yarn,factor=4,original_max_position_embeddings=8192",
           "TYPE:FACTOR"),
    Option("prefill_chunk", int, "prompt tokens per prefill forward"),
    Option("kv_block_size", int, "positions per KV-cache block"),
    Option("kv_cache_bytes", parse_optional_bytes, "cache budget: bytes the KV cache and the methods' state may "
                                                   "hold together, e.g. 8GiB (none = --kv-cache-fraction of the "
                                                   "memory free once the model is loaded); past it idle sessions "
                                                   "are evicted, least recently used first", "BYTES"),
    Option("kv_cache_fraction", float, "share of the free device memory (CPU: available RAM) the cache budget "
                                       "takes when --kv-cache-bytes is none", "F"),
    Option("prefix_cache", parse_bool, "reuse the KV blocks of a prompt's start that an earlier prompt of the same "
                                       "API key (and cache_salt) prefilled; idle cached blocks go first when the "
                                       "cache budget is short (false = prefill every prompt whole)", "BOOL"),
    Option("prefix_cache_bytes", parse_optional_bytes, "most bytes the prefix cache keeps in blocks no session "
                                                       "holds once a session closes, least recently used evicted "
                                                       "first, e.g. 64MiB (none = up to the cache budget)", "BYTES"),
    Option("prefix_cache_shared", parse_bool, "share cached prefixes across API keys (single-tenant deployments: "
                                              "a prompt's time to first token reveals whether another key sent "
                                              "the same start; cache_salt still separates)", "BOOL"),
    Option("max_queue", int, "requests waiting for admission; beyond it Generate is RESOURCE_EXHAUSTED"),
    Option("max_running", int, "requests decoded together in one batch"),
    Option("max_sessions", int, "open sessions; beyond it CreateSession is RESOURCE_EXHAUSTED"),
    Option("session_idle_timeout_s", parse_optional_float, "close a session unused for this many seconds, "
                                                           "freeing its cache (none = never)", "S"),
    Option("max_prompt_tokens", parse_optional_int, "tokens one request may feed (none = the model's context)", "N"),
    Option("max_new_tokens", int, "largest max_new_tokens a request may ask for"),
    Option("default_max_new_tokens", int, "max_new_tokens of a request that sets none"),
    Option("max_step_tokens", int, "tokens one scheduler iteration computes: the running batch's decode tokens, "
                                   "the rest as prefill chunks (a long prompt no longer stalls running streams)"),
    Option("watchdog_timeout_s", parse_optional_float, "with work pending, seconds one engine loop iteration may "
                                                       "take before the engine counts as hung: health NOT_SERVING, "
                                                       "exit 70 (none = no watchdog; raise it with a large "
                                                       "--max-step-tokens on slow hardware)", "S"),
    Option("drain_grace_s", float, "seconds running requests get to finish after SIGTERM"),
    Option("api_key", parse_optional_str, "require metadata 'authorization: Bearer <key>' on every call "
                                          "(prefer the environment variable: flags show up in ps)", "KEY"),
    Option("api_keys_file", parse_optional_str, "file of named API keys, one NAME:SHA256HEX [max_streams=N] "
                                                "[max_sessions=N] per line ('retopk-server hash-key' makes a "
                                                "line); reloaded on SIGHUP or when it changes; sessions belong "
                                                "to the key that created them", "PATH"),
    Option("max_streams_per_key", parse_optional_int, "concurrent Generate streams of one key unless its line "
                                                      "says otherwise (none = --key-share of the server's)", "N"),
    Option("max_sessions_per_key", parse_optional_int, "open sessions of one key unless its line says otherwise "
                                                       "(none = --key-share of the server's)", "N"),
    Option("key_share", float, "share (0..1] of the server's sessions and streams (max-running + max-queue) one "
                               "key may hold, rounded up, unless --max-*-per-key or its keys-file line says "
                               "otherwise; the anonymous caller of a server without keys likewise (1 = none)", "F"),
    Option("reflection", parse_bool, "offer gRPC server reflection (the service schema, for grpcurl)", "BOOL"),
    Option("tls_cert", parse_optional_str, "PEM certificate chain: serve gRPC over TLS (with --tls-key)", "PATH"),
    Option("tls_key", parse_optional_str, "PEM private key of --tls-cert", "PATH"),
    Option("tls_client_ca", parse_optional_str, "PEM CA certificate(s): require client certificates signed by "
                                                "it (mutual TLS)", "PATH"),
    Option("session_dir", parse_optional_str, "directory the sessions left at a drain are written to (files "
                                              "readable by the server only) and loaded back from after a "
                                              "restart, in the background and on first use (a volume that "
                                              "outlives the process)", "DIR"),
    Option("session_dir_bytes", parse_optional_bytes, "most bytes --session-dir holds; the oldest sessions are "
                                                      "deleted first", "BYTES"),
    Option("handoff_peer", parse_optional_str, "at a drain, send every idle session to this address (the router's, "
                                               "so that each lands where its next call goes, or a replica's)",
           "ADDRESS"),
    Option("handoff_linger_s", float, "with --handoff-peer a replica clients can reach: keep listening while "
                                      "handing over and this many seconds after, telling each moved session's "
                                      "owner its new home (trailer x-retopk-handoff; the SDK follows it); 0 = "
                                      "stop listening first (a router peer)", "S"),
    Option("handoff_address", parse_optional_str, "the address the handoff notice names (default "
                                                  "--handoff-peer): the peer as clients reach it", "ADDRESS"),
    Option("peer_key", parse_optional_str, "secret shared by the replicas for handing sessions over on behalf of "
                                           "their owners (prefer the environment variable)", "KEY"),
    Option("log_level", str, "debug, info, warning or error"),
)


def build_parser() -> argparse.ArgumentParser:
    from retopk_server.config import ServerConfig

    defaults = ServerConfig.__dataclass_fields__
    parser = argparse.ArgumentParser(
        prog="retopk-server",
        description="gRPC LLM decoding server with ReTopK sparse attention. Every flag can also be set "
                    "with the environment variable shown; flags win over the environment.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    for opt in OPTIONS:
        f = defaults[opt.field]
        default = f.default_factory() if callable(f.default_factory) else f.default
        if isinstance(default, dict):
            default = format_params(default)
        parser.add_argument(opt.flag, dest=opt.field, default=argparse.SUPPRESS, metavar=opt.metavar,
                            help=f"{opt.help} [env {opt.env}; default {default}]")
    return parser


def config_from(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The ServerConfig of this command line and environment (flags > environment > defaults)."""
    from retopk_server.config import ServerConfig

    environ = os.environ if environ is None else environ
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    values: dict[str, object] = {}
    for opt in OPTIONS:
        source, text = None, None
        if opt.field in args:
            source, text = opt.flag, args[opt.field]
        elif opt.env in environ:
            source, text = opt.env, environ[opt.env]
        if source is None:
            continue
        try:
            values[opt.field] = opt.parse(text)
        except ValueError as e:
            parser.error(f"{source}: {e}")
    # A different default method starts from its own defaults, not from ReTopK's K = 64.
    if "method" in values and "method_params" not in values:
        values["method_params"] = {}
    known = {f.name for f in fields(ServerConfig)}
    try:
        return ServerConfig(**{k: v for k, v in values.items() if k in known})
    except ValueError as e:
        parser.error(str(e))


def hash_key_main(argv: list[str], stdin=None, stdout=None, stderr=None) -> int:
    """`retopk-server hash-key NAME`: print the keys-file line of a key read from stdin (or --generate'd)."""
    from retopk_server.service.auth import NAME_RE, generate_key, hash_key

    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    parser = argparse.ArgumentParser(
        prog="retopk-server hash-key",
        description="Print a --api-keys-file line for a key: NAME:SHA256HEX [limits]. The key is read from "
                    "stdin (printf %s \"$KEY\" | retopk-server hash-key alice >> keys.txt), or made up with "
                    "--generate and printed once on stderr. Only the hash goes into the file.")
    parser.add_argument("name", help="the key's name: the owner of its sessions (letters, digits, _ . @ -)")
    parser.add_argument("--generate", action="store_true", help="make a new random key (shown on stderr)")
    parser.add_argument("--max-streams", type=int, metavar="N", help="the key's concurrent Generate streams")
    parser.add_argument("--max-sessions", type=int, metavar="N", help="the key's open sessions")
    args = parser.parse_args(argv)
    if not NAME_RE.fullmatch(args.name):
        parser.error(f"name {args.name!r}: 1-64 letters, digits, _ . @ - (starting with a letter or digit)")
    for flag, value in (("--max-streams", args.max_streams), ("--max-sessions", args.max_sessions)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be a positive integer, got {value}")
    if args.generate:
        key = generate_key()
        print(f"API key for {args.name} (shown once; give it to its user): {key}", file=stderr, flush=True)
    elif hasattr(stdin, "isatty") and stdin.isatty():
        import getpass

        key = getpass.getpass(f"API key for {args.name}: ")
    else:
        key = stdin.read().strip("\r\n")
    if not key:
        parser.error("no key on stdin (or pass --generate)")
    limits = "".join(f" {name}={value}" for name, value in (("max_streams", args.max_streams),
                                                             ("max_sessions", args.max_sessions)) if value)
    print(f"{args.name}:{hash_key(key)}{limits}", file=stdout, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hash-key"]:
        return hash_key_main(argv[1:])
    enable_transparent_hugepages()  # before torch is imported: see retopk_core/hugepages.py
    config = config_from(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import asyncio

    from retopk_server.service.server import serve

    try:
        return asyncio.run(serve(config))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
