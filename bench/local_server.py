"""What the session benches (handoff.py, session_restart.py) share: their common options, ``main`` around the
bench's ``measure(args, model, tokenizer)`` (which the tests call with the embedded model they hold), the real
server in this process (``LocalServer``) and the JSON of ``--out``."""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path as FsPath

from retopk_core.hugepages import enable_transparent_hugepages
from retopk_core.models import DEFAULT_MODEL


def parse_args(doc: str, cache_bytes: int, options: Callable[[argparse.ArgumentParser], None],
               argv=None) -> argparse.Namespace:
    """--model, the bench's own ``options``, --threads, --cache-bytes (default ``cache_bytes``) and --out."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="model name or local checkpoint path")
    options(p)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    p.add_argument("--cache-bytes", type=int, default=cache_bytes, help="each server's --kv-cache-bytes")
    p.add_argument("--out", type=FsPath, default=None, help="write the result as JSON there")
    return p.parse_args(argv)


def main(parse: Callable[..., argparse.Namespace], measure: Callable[..., dict], argv=None) -> dict:
    """``measure(args, model, tokenizer)`` on the model ``--model`` names, with transparent huge pages on."""
    args = parse(argv)
    enable_transparent_hugepages()
    from retopk_core.models import load_model

    return measure(args, *load_model(args.model))


def server_config(args, **fields):
    """The ServerConfig of both servers: loopback, free ports, ``--model`` and ``--cache-bytes``, no idle timeout
    nor watchdog (a long prefill is not a hang), and the bench's ``fields``; sets torch's ``--threads``."""
    import torch

    from retopk_server.config import ServerConfig

    torch.set_num_threads(args.threads)
    return ServerConfig(host="127.0.0.1", port=0, metrics_port=0, model=args.model, kv_cache_bytes=args.cache_bytes,
                        session_idle_timeout_s=None, watchdog_timeout_s=None, **fields)


class LocalServer:
    """The real server (retopk_server.service.server.start) around a new runner of ``config`` on the loaded model,
    on an event loop thread."""

    def __init__(self, config, model, tokenizer) -> None:
        from retopk_server.engine import Engine
        from retopk_server.runtime import ModelRunner
        from retopk_server.service.server import start

        runner = ModelRunner(config.runtime_config(), model=model, tokenizer=tokenizer)
        self.engine = Engine(lambda: runner, config.engine_config())
        self.engine.start()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.running = asyncio.run_coroutine_threadsafe(start(config, self.engine), self.loop).result(60)
        self.address = f"127.0.0.1:{self.running.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.drain(0.0), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)


def write_result(args, result: dict) -> dict:
    """``result``, written as JSON to ``--out`` when given."""
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result
