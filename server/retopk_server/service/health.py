"""Health that tells the truth, and the exit of a server whose engine died.

grpc.health.v1 answers for two names, which docker/k8s's probes ask for (and the HTTP front's /health reads
readiness from ``Health.serving``):

    ""                       liveness: SERVING while the engine thread runs its loop (a drain included),
                             NOT_SERVING once the engine failed or hung
    "retopk.v1.ReTopKService" readiness: SERVING while the model is loaded, the engine alive and the
                             server not draining

The Supervisor polls the engine every ``interval_s``, running its watchdog (``Engine.check_hung``,
engine/supervision.py: with work pending, no loop iteration ended for ``--watchdog-timeout-s``). When the
engine loop died or hung (its ``failure``; engine/faults.py says when that happens) both names turn
NOT_SERVING and ``failed`` is set:
``serve`` then stops gRPC and exits with EXIT_ENGINE_FAILED, so that the orchestrator restarts the
process. Requests the dead engine held already ended with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from grpc_health.v1 import health, health_pb2

from retopk_server.engine import Engine
from retopk_shared.service_names import SERVICE_NAME

log = logging.getLogger("retopk_server")

LIVENESS, READINESS = "", SERVICE_NAME
EXIT_ENGINE_FAILED = 70  # sysexits' EX_SOFTWARE: the engine died; restart the process
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """The server's grpc.health.v1 answers: ``servicer`` (a grpc_health aio HealthServicer, served over gRPC) and
    the same statuses readable here without an rpc (``serving``)."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self._status: dict[str, int] = {}

    async def set(self, name: str, status: int) -> None:
        self._status[name] = status
        await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        """Every name NOT_SERVING, for good (the server stops)."""
        self._status = dict.fromkeys(self._status, NOT_SERVING)
        await self.servicer.enter_graceful_shutdown()

    def serving(self, name: str = READINESS) -> bool:
        return self._status.get(name) == SERVING


class Supervisor:
    """Keeps ``health`` (Health) in step with ``engine``; see the module docstring."""

    def __init__(self, engine: Engine, health: Health, interval_s: float = 0.2) -> None:
        self.engine, self.health, self.interval_s = engine, health, interval_s
        self.failed = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> Supervisor:
        """Both names SERVING, then watch the engine (call on the server's event loop)."""
        await self.health.set(LIVENESS, SERVING)
        await self.health.set(READINESS, SERVING)
        self._task = asyncio.create_task(self._watch(), name="retopk-supervisor")
        return self

    async def draining(self) -> None:
        """Readiness NOT_SERVING (routers stop sending work); liveness stays SERVING while the engine runs."""
        await self.health.set(READINESS, NOT_SERVING)

    async def _watch(self) -> None:
        while self.engine.failure is None:
            await asyncio.sleep(self.interval_s)
            self.engine.check_hung()  # a hung loop fails the engine (engine/supervision.py)
        log.critical("the engine failed (%s): health NOT_SERVING, the server exits", self.engine.failure)
        await self.health.set(READINESS, NOT_SERVING)
        await self.health.set(LIVENESS, NOT_SERVING)
        self.failed.set()

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
