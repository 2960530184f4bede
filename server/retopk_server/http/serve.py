"""HttpFront: uvicorn serving the OpenAI-compatible app inside the server's own asyncio loop, beside grpc.aio.

uvicorn's ``Server.serve`` would install its own SIGINT / SIGTERM handlers over the server's; this runs its
parts instead (bind, ``startup``, ``main_loop`` as a task, ``shutdown``), so the signals stay the gRPC
server's and the drain (``RunningServer.drain``) stops both fronts: new requests are refused with 503 once
the engine drains, running streams get the drain grace, then ``stop`` closes the listener and gives the
open connections uvicorn's graceful timeout (2 s) to finish.

TLS follows the gRPC front's: with ``tls_cert`` / ``tls_key`` the front is HTTPS with the same certificate,
and with ``tls_client_ca`` it asks for a client certificate signed by that CA (mutual TLS), so a key never
travels in clear text on one front while the other is encrypted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn

from retopk_server.http.app import create_app

log = logging.getLogger("retopk_server.http")


class HttpFront:
    """``await start()`` listens on ``config.host:config.http_port`` (0: any free port; ``self.port`` tells
    which); ``url`` is "http(s)://HOST:PORT"."""

    def __init__(self, gateway, health, config) -> None:
        self.app = create_app(gateway, health)
        self.config = config
        self.host, self.port = config.host, config.http_port
        self._server: uvicorn.Server | None = None
        self._sockets: list[socket.socket] = []
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.config.tls else 'http'}://{self.host}:{self.port}"

    async def start(self) -> None:
        """Bind and serve; raises OSError when the address is taken or not an address, or a TLS file unreadable."""
        cfg = self.config
        tls = dict(ssl_certfile=cfg.tls_cert, ssl_keyfile=cfg.tls_key, ssl_ca_certs=cfg.tls_client_ca,
                   ssl_cert_reqs=ssl.CERT_REQUIRED if cfg.tls_client_ca else ssl.CERT_NONE) if cfg.tls else {}
        config = uvicorn.Config(self.app, host=self.host, port=self.port, lifespan="off", access_log=False,
                                log_level=cfg.log_level.lower(), log_config=None, server_header=False,
                                timeout_graceful_shutdown=2, **tls)
        config.load()  # builds the TLS context: ssl.SSLError (an OSError) for a bad file
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family)
        sock.setblocking(False)
        self._sockets = [sock]
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)  # what Server._serve sets up first ("off")
        await self._server.startup(sockets=self._sockets)
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
