"""HttpFront: uvicorn serving the OpenAI-compatible app inside the server's own asyncio loop, beside grpc.aio.

uvicorn's ``Server.serve`` would install its own SIGINT / SIGTERM handlers over the server's; this runs its
parts instead (bind, ``startup``, ``main_loop`` as a task, ``shutdown``), so the signals stay the gRPC
server's and the drain (``RunningServer.drain``) stops both fronts: new requests are refused with 503 once
the engine drains, running streams get the drain grace, then ``stop`` closes the listener and gives the
open connections ``grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from retopk_server.http.app import create_app

log = logging.getLogger("retopk_server.http")


class HttpFront:
    """``await start()`` listens on ``host:port`` (0: any free port; ``self.port`` tells which)."""

    def __init__(self, servicer, health_servicer, host: str, port: int, log_level: str = "info") -> None:
        self.app = create_app(servicer, health_servicer)
        self.host, self.port = host, port
        self._log_level = log_level
        self._server: uvicorn.Server | None = None
        self._sockets: list[socket.socket] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind and serve; raises OSError when the address is taken or not an address."""
        config = uvicorn.Config(self.app, host=self.host, port=self.port, lifespan="off", access_log=False,
                                log_level=self._log_level.lower(), log_config=None, server_header=False,
                                timeout_graceful_shutdown=2)
        config.load()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, reuse_port=False)
        sock.setblocking(False)
        self._sockets = [sock]
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)  # what Server._serve sets up first ("off")
        await self._server.startup(sockets=self._sockets)
        if self._server.should_exit:  # startup logged why
            sock.close()
            raise OSError(f"could not serve HTTP on {self.host}:{self.port}")
        self._task = asyncio.create_task(self._server.main_loop(), name="retopk-http")

    async def stop(self) -> None:
        """Stop listening, let open connections finish (uvicorn's graceful timeout), close the rest."""
        if self._server is None:
            return
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        await self._server.shutdown(sockets=self._sockets)
        self._server = None
