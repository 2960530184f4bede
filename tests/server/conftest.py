"""Server test fixtures.

live_server   (session) address "127.0.0.1:PORT" of ONE real `retopk-server` process with the embedded
              model, shared by every test of the session (loading it costs ~18 s). Launched by
              tests/_live_server.py, which other conftests can import too.
live_stub     (session) a ReTopKService stub on a channel to it.
fake_server   an in-process gRPC server (the real service code) around a FakeRunner: fast, no model.
              Call ``fake_server(**server_config_overrides)``; it returns a FakeServer.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.config import ServerConfig
from retopk_server.engine import Engine
from retopk_server.service.server import start
from tests.server.fake_runner import FakeRunner


@pytest.fixture(scope="session")
def live_stub(live_server):
    with grpc.insecure_channel(live_server) as channel:
        yield pb_grpc.ReTopKServiceStub(channel)


class FakeServer:
    """The real servicer, health and reflection on 127.0.0.1:<free port>, with a FakeRunner engine,
    on an event loop in a background thread. ``drain(grace)`` runs the server's own drain."""

    def __init__(self, runner: FakeRunner, **overrides) -> None:
        overrides.setdefault("max_new_tokens", 2000)
        self.config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, **overrides)
        self.runner = runner
        self.engine = Engine(lambda: runner, self.config.engine_config())
        self.engine.start()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-server-loop", daemon=True)
        self._thread.start()
        self.running = self._run(start(self.config, self.engine))
        self.address = f"127.0.0.1:{self.running.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.ReTopKServiceStub(self.channel)
        self._stopped = False

    def _run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def drain(self, grace_s: float = 0.0) -> None:
        if not self._stopped:
            self._stopped = True
            self._run(self.running.drain(grace_s), timeout=grace_s + 30)

    def close(self) -> None:
        self.channel.close()
        self.drain(0.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def fake_server():
    servers: list[FakeServer] = []

    def make(runner: FakeRunner | None = None, **overrides) -> FakeServer:
        servers.append(FakeServer(runner or FakeRunner(), **overrides))
        return servers[-1]

    yield make
    for server in servers:
        server.close()
