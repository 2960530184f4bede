"""ServerConfig: everything the server is configured with, in one validated dataclass.

The command line and the RETOPK_* environment variables map onto it in ``retopk_server.cli`` (flags
override the environment, the environment overrides these defaults). The runtime and the engine get
their own configs from it (``runtime_config``, ``engine_config``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from retopk_core.methods.registry import serving_method_names
from retopk_core.params import ParamError, check_int, check_number
from retopk_server.engine.requests import EngineConfig
from retopk_server.runtime.cpu_threads import MAX_THREADS
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.runtime_config import DEFAULT_METHOD_PARAMS, RuntimeConfig

MAX_HANDOFF_LINGER_S = 600.0  # a drain's linger (handoff_linger_s) is bounded: the process must end


def _default_method_params() -> dict:
    # the runtime's default ReTopK (see retopk_server.runtime.runtime_config); other methods start from their own
    return dict(DEFAULT_METHOD_PARAMS)


@dataclass
class ServerConfig:
    """The server's configuration.

    host, port            where gRPC listens (port 0: any free port, printed when ready)
    metrics_port          Prometheus exporter port (0 disables it); used by retopk_server.metrics
    http_port             the OpenAI-compatible HTTP front's port on ``host`` (None: off; 0: any free port,
                          printed when ready); retopk_server.http
    metrics_per_head      export the metrics built from every step's per-head statistics (path decisions
                          per layer x head, candidates, similarity, exact share, attention time); those
                          statistics cost a GPU a synchronisation per layer, so false turns them off
    model, device, weights, kv_dtype, activations, backend, max_context, rope_scaling, prefill_chunk, kv_block_size,
    kv_cache_bytes, kv_cache_fraction, prefix_cache, prefix_cache_bytes
                          the model runtime's settings: documented in, and defaulting to, RuntimeConfig
    threads               threads of the model's CPU work (torch's intra-op pool); None: the CPUs this process
                          may use (its affinity, capped by the cgroup's CPU quota), or torch's own choice when
                          OMP_NUM_THREADS is set (runtime/cpu_threads.py)
    method, method_params default attention method of requests and sessions that name none
    max_queue, max_running, max_sessions, max_prompt_tokens, max_new_tokens, default_max_new_tokens,
    max_step_tokens, prefix_cache_shared  the engine's limits: documented in, and defaulting to, EngineConfig
    session_idle_timeout_s  a named session unused for this long is closed (None: never; the engine's own
                          default is None, a server's one hour)
    watchdog_timeout_s    with work pending, the engine loop stuck in one iteration this long means a hung engine
                          thread: health NOT_SERVING, exit 70 (None: no watchdog); EngineConfig documents it
    drain_grace_s         after SIGTERM, how long running requests may take to finish before they are cut
    api_key               when set, every retopk.v1 rpc needs metadata "authorization: Bearer <api_key>" (a key
                          named "default"; with api_keys_file, one more key)
    api_keys_file         file of named, hashed API keys with per-key limits, reloaded on SIGHUP or when it
                          changes (format: retopk_server.service.auth); with keys, every retopk.v1 rpc needs one
                          and sessions belong to the key that created them
    max_streams_per_key, max_sessions_per_key
                          a key's concurrent Generate streams / open sessions unless its line sets its own
                          (None: ``key_share`` of the server's)
    key_share             the share (0..1] of the server's sessions (max_sessions) and streams (max_running +
                          max_queue) one key may hold unless max_*_per_key or its keys-file line says otherwise,
                          rounded up; the anonymous owner of a server without keys gets the same, so one caller
                          cannot take every session and stream (1: no per-key bound below the server's)
    reflection            offer gRPC server reflection (the proto's schema; no data) for grpcurl and friends
    tls_cert, tls_key     PEM files of the server's certificate chain and private key: gRPC over TLS
    tls_client_ca         PEM file of the CA that signs client certificates: mutual TLS, a client without
                          one is refused in the handshake (needs tls_cert)
    session_dir           a directory where the sessions left at a drain are written (one artifact file each, mode
                          0600, the directory 0700) and from which a later server loads them back, in the
                          background from its start and each on its first use (engine/session_store.py,
                          service/saved_sessions.py; None: sessions end with the process)
    session_dir_bytes     the most bytes session_dir holds; past it the oldest files are deleted first
    handoff_peer          at a drain, send every idle session there (ImportSession) once this server stopped
                          listening: the router's address (docs/deploy.md: the router's consistent hash then
                          places each session on the replica that receives its next call) or a replica's
    handoff_linger_s      with handoff_peer a replica's address that clients can reach: the drain keeps listening
                          while it hands the sessions over and this many seconds after, answering a call on a moved
                          session, for its owner only, UNAVAILABLE with the trailer x-retopk-handoff naming its new
                          home, which the SDK follows without replay (service/handoff.py). 0: stop listening
                          first, for a router peer whose ring finds each session's new home (docs/deploy.md)
    handoff_address       the address that trailer names (default handoff_peer): the peer as clients reach it
    peer_key              the secret replicas share to import each other's sessions on behalf of their owners
                          (metadata x-retopk-peer-key; needed when the servers have API keys)
    log_level             Python logging level name
    """

    host: str = "0.0.0.0"
    port: int = 50051
    metrics_port: int = 9464
    http_port: int | None = None
    metrics_per_head: bool = True
    model: str = RuntimeConfig.model
    device: str = RuntimeConfig.device
    weights: str = RuntimeConfig.weights
    kv_dtype: str = RuntimeConfig.kv_dtype
    activations: str = RuntimeConfig.activations
    backend: str = RuntimeConfig.backend
    threads: int | None = None
    method: str = "retopk"
    method_params: dict = field(default_factory=_default_method_params)
    max_context: int | None = RuntimeConfig.max_context
    rope_scaling: dict | None = RuntimeConfig.rope_scaling
    prefill_chunk: int = RuntimeConfig.prefill_chunk
    kv_block_size: int = RuntimeConfig.kv_block_size
    kv_cache_bytes: int | None = RuntimeConfig.kv_cache_bytes
    kv_cache_fraction: float = RuntimeConfig.kv_cache_fraction
    prefix_cache: bool = RuntimeConfig.prefix_cache
    prefix_cache_bytes: int | None = RuntimeConfig.prefix_cache_bytes
    prefix_cache_shared: bool = EngineConfig.prefix_cache_shared
    max_queue: int = EngineConfig.max_queue
    max_running: int = EngineConfig.max_running
    max_sessions: int = EngineConfig.max_sessions
    session_idle_timeout_s: float | None = 3600.0
    max_prompt_tokens: int | None = EngineConfig.max_prompt_tokens
    max_new_tokens: int = EngineConfig.max_new_tokens
    default_max_new_tokens: int = EngineConfig.default_max_new_tokens
    max_step_tokens: int = EngineConfig.max_step_tokens
    watchdog_timeout_s: float | None = EngineConfig.watchdog_timeout_s
    drain_grace_s: float = 30.0
    api_key: str | None = None
    api_keys_file: str | None = None
    max_streams_per_key: int | None = None
    max_sessions_per_key: int | None = None
    key_share: float = 0.5
    reflection: bool = True
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    session_dir: str | None = None
    session_dir_bytes: int = 8 << 30
    handoff_peer: str | None = None
    handoff_linger_s: float = 0.0
    handoff_address: str | None = None
    peer_key: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host must be a non-empty string, got {self.host!r}")
        for name in ("port", "metrics_port", "http_port"):
            if getattr(self, name) is None and name == "http_port":
                continue
            check_int(name, getattr(self, name), low=0)
            if getattr(self, name) > 65535:
                raise ParamError(name, f"{name} must be an integer in [0, 65535], got {getattr(self, name)!r}")
        for name in ("metrics_per_head", "prefix_cache", "prefix_cache_shared"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.method_params, dict):
            raise ValueError(f"method_params must be a dict, got {self.method_params!r}")
        check_number("drain_grace_s", self.drain_grace_s, low=0)
        check_int("threads", self.threads, low=1, optional=True)
        if self.threads is not None and self.threads > MAX_THREADS:
            raise ParamError("threads", f"threads must be at most {MAX_THREADS}, got {self.threads}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        self._check_security()
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level must be debug, info, warning, error or critical, got {self.log_level!r}")
        if self.method not in (names := serving_method_names()):
            raise ValueError(f"method: unknown method {self.method!r}; choose one of {', '.join(names)}")
        try:
            self.method_spec().build()
        except ValueError as e:
            raise ValueError(f"method: {e}") from None
        self.runtime_config()  # validates the runtime's settings (model, weights, kv_dtype, backend, sizes, ...)
        self.engine_config()  # validates the limits

    def _check_security(self) -> None:
        for name in ("api_keys_file", "tls_cert", "tls_key", "tls_client_ca"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a file path or None, got {value!r}")
        for name in ("max_streams_per_key", "max_sessions_per_key"):
            check_int(name, getattr(self, name), low=1, optional=True)
        check_number("key_share", self.key_share, low=0, high=1)
        if self.key_share == 0:
            raise ParamError("key_share", "key_share must lie in (0, 1], got 0")
        if not isinstance(self.reflection, bool):
            raise ValueError(f"reflection must be true or false, got {self.reflection!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: set both (the certificate chain and its private key) or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca: mutual TLS needs the server's own tls_cert and tls_key")
        for name in ("session_dir", "handoff_peer", "handoff_address", "peer_key"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        check_int("session_dir_bytes", self.session_dir_bytes, low=1)
        check_number("handoff_linger_s", self.handoff_linger_s, low=0, high=MAX_HANDOFF_LINGER_S)
        if (self.handoff_linger_s or self.handoff_address) and self.handoff_peer is None:
            raise ParamError("handoff_linger_s", "handoff_linger_s and handoff_address need handoff_peer (where the "
                                                 "sessions go)")

    def key_limits(self) -> tuple[int | None, int | None]:
        """(max_streams, max_sessions) of a key whose keys-file line sets none, and of the anonymous owner:
        max_*_per_key when set, else ``key_share`` of the server's streams and sessions, rounded up (None: no
        per-key bound, at key_share 1)."""
        if self.key_share >= 1:  # the whole server: no bound of its own, so the server's limits answer
            return self.max_streams_per_key, self.max_sessions_per_key
        streams = self.max_streams_per_key or math.ceil(self.key_share * (self.max_running + self.max_queue))
        sessions = self.max_sessions_per_key or math.ceil(self.key_share * self.max_sessions)
        return streams, sessions

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def method_spec(self) -> MethodSpec:
        return MethodSpec(self.method, tuple(self.method_params.items()))

    def runtime_config(self) -> RuntimeConfig:
        return RuntimeConfig(model=self.model, device=self.device, weights=self.weights, kv_dtype=self.kv_dtype,
                             activations=self.activations, backend=self.backend,
                             default_method=self.method_spec(), max_context=self.max_context,
                             rope_scaling=self.rope_scaling, prefill_chunk=self.prefill_chunk,
                             kv_block_size=self.kv_block_size, kv_cache_bytes=self.kv_cache_bytes,
                             kv_cache_fraction=self.kv_cache_fraction, prefix_cache=self.prefix_cache,
                             prefix_cache_bytes=self.prefix_cache_bytes)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_queue=self.max_queue, max_running=self.max_running, max_sessions=self.max_sessions,
                            max_prompt_tokens=self.max_prompt_tokens, max_new_tokens=self.max_new_tokens,
                            default_max_new_tokens=self.default_max_new_tokens, max_step_tokens=self.max_step_tokens,
                            session_idle_timeout_s=self.session_idle_timeout_s,
                            watchdog_timeout_s=self.watchdog_timeout_s, prefix_cache_shared=self.prefix_cache_shared)
