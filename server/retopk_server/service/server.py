"""Server startup and shutdown: engine, gRPC services (ours, health, reflection), signals, drain.

Lifecycle of ``serve``:
  1. load the model on the engine thread (SIGTERM during the load exits 0 right after it); check the
     default method (--method, --method-params) against the model's method limits
     (runtime/method_limits.py): a value past them is one line naming it and exit code 2, as argparse's
  2. start grpc.aio with ReTopKService, grpc.health.v1.Health (SERVING, public: no key needed) and
     server reflection (unless --reflection false), over TLS when --tls-cert is set (mutual TLS with
     --tls-client-ca); print "retopk-server listening on HOST:PORT"; SIGHUP reloads the keys file;
     with --http-port also the OpenAI-compatible HTTP front (retopk_server.http) in the same event loop,
     printing "retopk-server HTTP (OpenAI API) on http(s)://HOST:PORT/v1"; the drain below stops both
  3. on SIGTERM / SIGINT drain: readiness NOT_SERVING (liveness stays SERVING: service/health.py), new
     Generate / CreateSession calls UNAVAILABLE, queued and running requests get ``drain_grace_s`` to
     finish, then what is left is cut with UNAVAILABLE, the server stops listening; with --handoff-peer or
     --session-dir the sessions left are then handed over or saved (service/handoff.py; at least
     KEEP_SESSIONS_MIN_S, past the grace), the engine stops and ``serve`` returns 0. With
     --handoff-linger-s the server still listens while it hands them over and lingers that long after, so that
     a call on a moved session gets the notice naming its new home; then it stops listening.
  4. when the engine dies or hangs (engine/faults.py, engine/supervision.py) health turns NOT_SERVING, the
     server stops and ``serve`` returns EXIT_ENGINE_FAILED (70), so that an orchestrator restarts the
     process; during a drain too.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from retopk_core.params import ParamError
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.config import ServerConfig
from retopk_server.engine import Engine, EngineObserver, Runner
from retopk_server.engine.session_store import SessionStore
from retopk_server.runtime.cpu_threads import apply_threads
from retopk_server.runtime.method_limits import check_server_method
from retopk_server.service.auth import KeyRing, KeysFileError
from retopk_server.service.gateway import Gateway
from retopk_server.service.handoff import keep_sessions
from retopk_server.service.health import EXIT_ENGINE_FAILED, Health, Supervisor
from retopk_server.service.limits import InputLimits
from retopk_server.service.servicer import ReTopKServicer
from retopk_shared.service_names import SERVICE_NAME

log = logging.getLogger("retopk_server")

MAX_SEND_BYTES = 64 << 20  # replies: step statistics of long streams, session lists
EXIT_USAGE = 2  # a flag's value is refused, as argparse exits
KEEP_SESSIONS_MIN_S = 10.0  # handing over or saving the sessions gets at least this long, past the drain grace


def grpc_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """gRPC server options: requests up to ``max_receive_bytes`` (service/limits.py's max_message_bytes)."""
    return [("grpc.max_receive_message_length", max_receive_bytes), ("grpc.max_send_message_length", MAX_SEND_BYTES)]


def server_version() -> str:
    try:
        from importlib.metadata import version

        return version("retopk")
    except Exception:
        return "0.0.0+unknown"


def make_observer(config: ServerConfig) -> EngineObserver:
    """The metrics observer when ``retopk_server.metrics`` provides ``create_observer(config)``, else no-op hooks."""
    try:
        from retopk_server import metrics
    except ModuleNotFoundError as e:
        if e.name != "retopk_server.metrics":
            raise
        return EngineObserver()
    factory = getattr(metrics, "create_observer", None)
    return factory(config) if factory is not None else EngineObserver()


def default_runner_factory(config: ServerConfig) -> Callable[[], Runner]:
    def build():
        from retopk_server.runtime.runner import ModelRunner

        return ModelRunner(config.runtime_config())

    return build


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the PEM files of ``config`` (None without tls_cert); OSError if unreadable."""
    if not config.tls:
        return None

    def read(path):
        with open(path, "rb") as f:
            return f.read()

    client_ca = read(config.tls_client_ca) if config.tls_client_ca else None
    return grpc.ssl_server_credentials([(read(config.tls_key), read(config.tls_cert))],
                                       root_certificates=client_ca, require_client_auth=client_ca is not None)


class RunningServer:
    """A started server: ``port``, ``engine``, ``health``, ``keys`` (the KeyRing); ``drain()`` shuts it down."""

    supervisor: Supervisor | None = None  # keeps health in step with the engine (``start`` sets it)

    def __init__(self, config: ServerConfig, server: grpc.aio.Server, engine: Engine,
                 health: Health, port: int, keys: KeyRing | None = None, store: SessionStore | None = None,
                 gateway: Gateway | None = None) -> None:
        self.config, self.server, self.engine, self.health, self.port = config, server, engine, health, port
        self.gateway = gateway
        self.keys = keys
        self.http = None  # the OpenAI-compatible HTTP front (retopk_server.http.serve.HttpFront) when on
        self.store = store  # --session-dir
        self.saved = None  # its sessions' return after a restart (service/saved_sessions.py), with store

    async def drain(self, grace_s: float | None = None) -> None:
        grace_s = self.config.drain_grace_s if grace_s is None else grace_s
        log.info("draining: not serving, waiting up to %.1f s for %d requests", grace_s, self.engine.in_flight())
        lingering = self.keeps_sessions and self.config.handoff_linger_s > 0
        if lingering:  # calls on the sessions about to move wait for their notice (service/handoff_notices.py)
            self.gateway.notices.begin()
        if self.supervisor is not None:  # readiness NOT_SERVING; liveness SERVING while the engine runs
            await self.supervisor.draining()
        self.engine.start_drain()
        deadline = time.monotonic() + grace_s
        while self.engine.in_flight() and self.engine.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        keep = self.keeps_sessions and self.engine.failure is None
        if self.engine.in_flight():
            log.warning("drain grace over; cutting %d requests", self.engine.in_flight())
            if not keep:
                await asyncio.to_thread(self.engine.stop)  # they end with UNAVAILABLE
        keep_until = max(deadline, time.monotonic() + KEEP_SESSIONS_MIN_S) if keep else None
        if keep and lingering:
            await self._hand_over_listening(keep_until)
            keep_until = None
        self.gateway.notices.finish()  # whatever happened (an engine failure: no handoff), no call waits on
        await self._stop(keep_until=keep_until)
        log.info("stopped")

    async def _hand_over_listening(self, keep_until: float) -> None:
        """--handoff-linger-s: hand the sessions over while still listening, then linger, so that a call on a moved
        session gets the notice naming its new home (service/handoff.py) rather than a refused connection."""
        self.gateway.cut_streams()
        if self.saved is not None:
            await self.saved.stop()  # as _stop does: a preload under way ends before the sessions are kept
        await self._kept_sessions(keep_until, self.gateway.notices)
        log.info("drain: answering calls on moved sessions with their new home for %.1f s",
                 self.config.handoff_linger_s)
        await asyncio.sleep(self.config.handoff_linger_s)

    async def _kept_sessions(self, keep_until: float, notices=None) -> None:
        """Once the requests cut have left the engine, hand over or save the sessions left (service/handoff.py)."""
        while self.engine.in_flight() and self.engine.failure is None and time.monotonic() < keep_until:
            await asyncio.sleep(0.05)  # a cut stream ends at the engine's next step, its session then idle
        if self.engine.failure is not None:
            return
        try:
            await keep_sessions(self.engine, keep_until, self.config.handoff_peer, self.config.peer_key, self.store,
                                notices, self.config.handoff_address)
        except Exception:  # noqa: BLE001 - the shutdown goes on; the sessions end with the process
            log.exception("handing over or saving the sessions failed")

    @property
    def keeps_sessions(self) -> bool:
        """Sessions outlive this process at a drain: --handoff-peer or --session-dir (service/handoff.py)."""
        return self.config.handoff_peer is not None or self.store is not None

    async def abort(self) -> None:
        """The engine failed (the supervisor said so): stop at once; its requests already ended UNAVAILABLE."""
        await self._stop()
        log.info("stopped after an engine failure")

    async def _stop(self, keep_until: float | None = None) -> None:
        """Stop listening, then (``keep_until``: a time.monotonic() deadline) hand over or save the sessions left,
        once the requests the stop cut have left the engine, then stop the engine."""
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.health.shutdown()  # every name NOT_SERVING
        # Let the handlers write the last messages (and the statuses of cut requests) out.
        if self.http is not None:  # stops listening; open connections get its graceful timeout
            await self.http.stop()
        await self.server.stop(grace=2.0)
        if self.saved is not None:
            await self.saved.stop()  # before the sessions are kept: a preload under way ends first
        if keep_until is not None:
            await self._kept_sessions(keep_until)
        await asyncio.to_thread(self.engine.stop)


async def start(config: ServerConfig, engine: Engine, keys: KeyRing | None = None) -> RunningServer:
    """Start gRPC for an engine that is already running; returns once it accepts calls.

    ``keys`` defaults to the config's KeyRing (KeysFileError for a bad keys file); OSError when a
    TLS file cannot be read, RuntimeError when the port cannot be bound.
    """
    keys = keys if keys is not None else KeyRing.from_config(config)
    credentials = server_credentials(config)
    server = grpc.aio.server(options=grpc_options(InputLimits.of(config, engine.info).max_message_bytes))
    store = SessionStore(config.session_dir, config.session_dir_bytes) if config.session_dir else None
    gateway = Gateway(engine, config, version=server_version(), keys=keys, store=store)
    pb_grpc.add_ReTopKServiceServicer_to_server(ReTopKServicer(gateway), server)
    health_status = Health()
    health_pb2_grpc.add_HealthServicer_to_server(health_status.servicer, server)
    if config.reflection:
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if gateway.saved is not None:
        await gateway.saved.make_room()
    await server.start()
    running = RunningServer(config, server, engine, health_status, port, keys, store, gateway)
    running.supervisor = await Supervisor(engine, health_status).start()  # liveness and readiness SERVING
    if gateway.saved is not None:
        running.saved = gateway.saved
        running.saved.start_preload()
    if config.http_port is not None:
        from retopk_server.http.serve import HttpFront  # fastapi and uvicorn load only when the front is on

        running.http = HttpFront(gateway, health_status, config)
        try:
            await running.http.start()
        except OSError as e:  # the port is taken or the host is not an address
            await server.stop(None)
            raise RuntimeError(f"HTTP port {config.http_port}: {e}") from None
    return running


async def serve(config: ServerConfig, runner_factory: Callable[[], Runner] | None = None,
                observer: EngineObserver | None = None) -> int:
    """Run the server until SIGTERM / SIGINT, then drain; returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        keys = KeyRing.from_config(config)  # before the model load: a bad keys file fails at once
        server_credentials(config)
    except (KeysFileError, OSError, ValueError) as e:
        log.error("%s", e)
        return 1
    if keys.keys_file is not None:
        loop.add_signal_handler(signal.SIGHUP, keys.reload)
    try:
        observer = observer or make_observer(config)
    except RuntimeError as e:  # e.g. the metrics port is taken
        log.error("%s", e)
        return 1
    engine = Engine(runner_factory or default_runner_factory(config), config.engine_config(), observer)
    threads = apply_threads(config.threads)
    log.info("loading model %s on %s (weights %s, KV cache %s, activations %s, backend %s, %d CPU threads)",
             config.model, config.device, config.weights, config.kv_dtype, config.activations, config.backend,
             threads)
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(engine.start)
    except Exception as e:
        log.error("could not load the model: %s: %s", type(e).__name__, e)
        return 1
    log.info("model ready in %.1f s: weights %s", time.monotonic() - t0, engine.info.weight_format)  # "auto" resolved
    try:
        check_server_method(config.method_spec(), engine.info)
    except ParamError as e:
        log.error("--method-params: %s", e)
        engine.stop()
        return EXIT_USAGE
    if stop.is_set():
        engine.stop()
        return 0
    try:
        running = await start(config, engine, keys)
    except RuntimeError as e:  # the port is taken or the host is not an address
        log.error("could not listen on %s:%d: %s", config.host, config.port, e)
        engine.stop()
        return 1
    print(f"retopk-server listening on {config.host}:{running.port}", flush=True)
    if running.http is not None:
        print(f"retopk-server HTTP (OpenAI API) on {running.http.url}/v1", flush=True)
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(running.supervisor.failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if running.supervisor.failed.is_set():
        await running.abort()
        return EXIT_ENGINE_FAILED
    await running.drain()
    if engine.failure is not None:  # it failed or hung while draining
        log.critical("the engine failed during the drain (%s): the server exits", engine.failure)
        return EXIT_ENGINE_FAILED
    return 0
