"""The layer both fronts call: who is calling, a checked request, its submission, its responses, its errors.

The gRPC servicer (service/servicer.py) and the OpenAI routes (http/app.py) each read their own wire (gRPC
metadata or HTTP headers, a GenerateRequest or a JSON body turned into one) and hand it here; neither calls
the other. Whatever goes wrong leaves as a ``CallError``, whose ``code`` (a gRPC status name) is the status
the gRPC front answers and whose ``http_status`` is the HTTP front's, so the two fronts fail alike.

Metrics: ``Gateway.call(name)`` is one call's record; it reports ``on_error`` for a refusal and ``on_rpc``
(its final code and duration) exactly once, whichever front answered.

Session affinity: a router keeps a session on its replica by hashing ``x-session-id`` (SESSION_METADATA),
which clients send on every call that names a session. When present it must equal the session the body names
(and a body must name one), else INVALID_ARGUMENT: a request routed by one id must not act on another session.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import Callable, Sequence

import grpc

from retopk_core.methods.registry import serving_method_names
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.config import ServerConfig
from retopk_server.engine import Engine, EngineError, EngineObserver, RequestStream, describe_method
from retopk_server.engine.observer import hook_of
from retopk_server.engine.requests import MAX_N, MAX_TOOLS, MAX_TOP_LOGPROBS, ErrorCode, GenerationRequest
from retopk_server.engine.session_store import SessionStore
from retopk_server.runtime.constraints import ConstraintError
from retopk_server.runtime.prefix_cache import MAX_CACHE_SALT_CHARS
from retopk_server.service import wire
from retopk_server.service.auth import Caller, KeyRing, Unauthenticated
from retopk_server.service.handoff_notices import NOTICE_METADATA, HandoffNotices
from retopk_server.service.limits import InputLimits
from retopk_server.service.quota import StreamQuota, TooManyStreams
from retopk_server.service.saved_sessions import SavedSessions
from retopk_server.service.wire import InvalidArgument
from retopk_shared.metadata import AUTHORIZATION, SESSION_METADATA

log = logging.getLogger("retopk_server.service")

Metadata = Sequence[tuple[str, str]]  # gRPC invocation metadata, or the HTTP headers of the same names
PEER_METADATA = "x-retopk-peer-key"  # a replica handing a session over presents the servers' shared peer_key
PEER = Caller("")  # such a replica: ImportSession then opens the session as its artifact's owner

# gRPC status name -> the HTTP status the OpenAI front answers with it
HTTP_STATUS: dict[str, int] = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "FAILED_PRECONDITION": 409,  # e.g. the session is busy with another request
    "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499,  # the client went away; nobody reads it
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}


class CallError(Exception):
    """End the call with ``code`` (a gRPC status name) and ``message`` (and, over gRPC, ``trailers``); ``grpc_status``
    and ``http_status`` are what each front answers with it (INTERNAL, 500: only ever a bug of ours)."""

    def __init__(self, code: str, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers  # trailers: gRPC's trailing metadata

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return grpc.StatusCode[self.code]

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    @classmethod
    def of(cls, exc: Exception) -> CallError:
        """The CallError of whatever a call raised; anything unforeseen is logged and INTERNAL."""
        if isinstance(exc, CallError):
            return exc
        if isinstance(exc, InvalidArgument):
            return cls("INVALID_ARGUMENT", str(exc))
        if isinstance(exc, Unauthenticated):
            return cls("UNAUTHENTICATED", str(exc))
        if isinstance(exc, TooManyStreams):
            return cls("RESOURCE_EXHAUSTED", str(exc))
        if isinstance(exc, EngineError):
            return cls(exc.code.value, exc.message)
        log.exception("internal error", exc_info=exc)
        return cls("INTERNAL", f"internal error: {type(exc).__name__}")


class Call:
    """One call's metrics: ``fail`` reports on_error and takes the error's code; ``end`` reports on_rpc once;
    ``stopped`` is both fronts' one way to end a call that raised. ``hook`` is the observer's (engine/observer.py's
    hook_of, which logs and swallows a failing hook)."""

    def __init__(self, hook: Callable[..., None], name: str) -> None:
        self.hook, self.name = hook, name
        self.code, self.t0, self.ended = "OK", time.monotonic(), False

    def fail(self, exc: Exception) -> CallError:
        error = CallError.of(exc)
        self.code = error.code
        self.hook("on_error", None, error.code)
        return error

    def stopped(self, exc: BaseException, cancelled: str = "CANCELLED") -> CallError | None:
        """End the call that ``exc`` stopped: an Exception is reported (``fail``) and gives the CallError to answer
        with; a cancellation (asyncio.CancelledError, any other BaseException) takes the code ``cancelled`` (what
        its client saw) and gives None, for the front to raise it on."""
        error = self.fail(exc) if isinstance(exc, Exception) else None
        if error is None:
            self.code = cancelled
        self.end()
        return error

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.hook("on_rpc", self.name, self.code, time.monotonic() - self.t0)


class Generation:
    """A submitted Generate: ``await anext(generation)`` its GenerateResponses (CallError when the engine ended it);
    ``close`` cancels it in the engine (a no-op once finished), frees the caller's stream and ends the call."""

    def __init__(self, call: Call, spec: GenerationRequest, stream: RequestStream, release) -> None:
        self.call, self.spec, self._stream, self._release = call, spec, stream, release
        self.final_sent = self.done = self.closed = False

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> pb.GenerateResponse:
        try:
            event = await anext(self._stream)
        except StopAsyncIteration:
            self.done = True
            raise
        except EngineError as exc:  # the engine already reported it to the observer
            self.call.code = exc.code.value
            raise CallError(exc.code.value, exc.message) from None
        self.final_sent = event.finish_reason is not None
        return wire.generate_response(event, self.spec.request_id)

    def close(self, cancelled: str = "CANCELLED") -> None:
        """A generation closed before its end was cut by its client (``cancelled``: CANCELLED, or
        DEADLINE_EXCEEDED past its deadline); one whose client had the last response (the SDK's complete()
        stops reading there) got every token, and its status is OK."""
        if self.closed:
            return
        self.closed = True
        if not self.done and not self.final_sent and self.call.code == "OK":
            self.call.code = cancelled
        self._stream.cancel()  # no-op when finished; otherwise the engine drops it at the next step
        self._release()
        self.call.end()


class Gateway:
    """One per server: the engine (started), its config and observer, the KeyRing, the per-key stream quota and
    the saved sessions of --session-dir (``store``)."""

    def __init__(self, engine: Engine, config: ServerConfig, observer: EngineObserver | None = None,
                 version: str = "", keys: KeyRing | None = None, store: SessionStore | None = None) -> None:
        self.engine, self.config, self.version = engine, config, version
        self.observer = observer or engine.observer
        self.hook = hook_of(self.observer)
        self.keys = keys if keys is not None else KeyRing.from_config(config)
        self.streams = StreamQuota()
        self.saved = SavedSessions(store, engine, self.limits.max_session_artifact_bytes,
                                   self.keys.caller) if store else None
        self.notices = HandoffNotices()  # sessions a lingering drain handed over (service/handoff.py)
        self._live: set[RequestStream] = set()  # the Generate streams under way

    @functools.cached_property
    def limits(self) -> InputLimits:
        """The input sizes a caller may send (service/limits.py), from the config and the loaded model."""
        return InputLimits.of(self.config, self.engine.info)

    def call(self, name: str) -> Call:
        return Call(self.hook, name)

    # ------------------------------------------------------------------------------------ who, where
    def authenticate(self, metadata: Metadata, peer: bool = False) -> Caller:
        """The caller (KeyRing.identify); Unauthenticated without a known key. With ``peer``, a replica that
        presents the servers' shared ``peer_key`` (PEER_METADATA) is PEER: it hands sessions over on behalf of
        their owners (service/handoff.py)."""
        if peer and self.config.peer_key is not None:
            sent = [v for k, v in metadata if k == PEER_METADATA]
            if len(sent) == 1 and hmac.compare_digest(sent[0].encode(), self.config.peer_key.encode()):
                return PEER
        sent = [v for k, v in metadata if k == AUTHORIZATION]
        return self.keys.identify(sent[0] if len(sent) == 1 else None)

    def check_affinity(self, metadata: Metadata, session_id: str | None) -> None:
        """The x-session-id metadata, when sent, must name the body's session (``session_id``)."""
        sent = [v for k, v in metadata if k == SESSION_METADATA]
        if not sent:
            return
        if len(sent) > 1 or sent[0] != session_id:
            body = f"session_id {session_id!r}" if session_id else "no session_id"
            raise InvalidArgument(SESSION_METADATA, f"metadata {', '.join(map(repr, sent))} does not match the "
                                  f"request, which names {body}; send the session's id (or no {SESSION_METADATA})")

    async def check_moved(self, caller: Caller, session_id: str | None) -> None:
        """A session this draining server handed over: UNAVAILABLE, for its owner with the trailer naming its new
        home (service/handoff.py); a call that comes before its session's turn in the handoff waits for it
        (service/handoff_notices.py)."""
        address = await self.notices.wait(caller.name, session_id)
        if address is not None:
            raise CallError("UNAVAILABLE", f"session_id: session {session_id!r} moved to {address} (this server is "
                            "draining); continue there", ((NOTICE_METADATA, address),))

    def cut_streams(self) -> int:
        """End every Generate under way with UNAVAILABLE, as a drain's grace ends (the engine drops each as a
        cancelled request, so its session keeps what the client was sent) -> how many."""
        cut = list(self._live)
        for stream in cut:
            stream.cut(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; the drain grace is over"))
        return len(cut)

    async def restore_saved(self, caller: Caller, session_id: str | None) -> None:
        """A session an earlier server saved in --session-dir comes back before its first use
        (service/saved_sessions.py)."""
        if self.saved is not None and session_id is not None:
            await self.saved.restore(caller.name, session_id, caller.max_sessions)

    # ------------------------------------------------------------------------------------ generate
    async def _compile(self, constraint, parts=()):
        """The compiled grammar of a request's constraint; InvalidArgument naming the field when it cannot be
        (for a forced tool call, whose schema joins every tool's: the first tool whose own schema fails)."""
        def compile_it():
            compiler = self.engine.constraints()
            try:
                return compiler.compile(constraint)
            except ConstraintError:
                for part in parts:
                    compiler.compile(part)
                raise

        try:
            return await asyncio.to_thread(compile_it)
        except ConstraintError as e:
            raise InvalidArgument(e.field, e.message) from None

    async def checked(self, caller: Caller, message: pb.GenerateRequest, deadline: float | None) \
            -> GenerationRequest:
        """The engine's GenerationRequest of ``message``, every field checked (InvalidArgument naming it): sizes,
        values, the method against the model (built once), the constraint compiled off the engine thread (cached
        by content)."""
        info = self.engine.info
        self.limits.generate(message)
        spec = wire.generation_request(message, info, self.config.max_new_tokens, deadline,
                                       self.engine.config.constraints)
        spec.owner = caller.name
        await self.restore_saved(caller, spec.session_id)
        if spec.constraint is not None:
            spec.grammar = await self._compile(spec.constraint, wire.tool_constraints(spec))
        return spec

    async def generate(self, call: Call, caller: Caller, message: pb.GenerateRequest, metadata: Metadata,
                       deadline: float | None) -> Generation:
        """Check and submit a Generate for ``caller`` (holding one of its streams until the Generation closes);
        raises before the engine took it."""
        self.streams.acquire(caller)
        try:
            session_id = message.session_id if message.HasField("session_id") else None
            self.check_affinity(metadata, session_id)
            await self.check_moved(caller, session_id)
            spec = await self.checked(caller, message, deadline)
            stream = RequestStream()
            self.engine.submit(spec, stream)
            self._live.add(stream)
        except BaseException:
            self.streams.release(caller)
            raise

        def release() -> None:
            self._live.discard(stream)
            self.streams.release(caller)

        return Generation(call, spec, stream, release)

    # ------------------------------------------------------------------------------------ model
    def model_info(self) -> pb.ModelInfo:
        info, cfg = self.engine.info, self.config
        default = info.default_method
        limits = pb.Limits(max_prompt_tokens=cfg.max_prompt_tokens or info.max_context,
                           max_new_tokens=cfg.max_new_tokens, default_max_new_tokens=cfg.default_max_new_tokens,
                           max_sessions=cfg.max_sessions, max_running=cfg.max_running, max_queue=cfg.max_queue,
                           max_top_logprobs=MAX_TOP_LOGPROBS)
        bounds = self.engine.config.constraints
        limits.MergeFrom(pb.Limits(max_constraint_chars=bounds.max_chars, max_constraint_depth=bounds.max_depth,
                                   constraint_compile_timeout_ms=round(bounds.compile_timeout_s * 1000),
                                   max_n=MAX_N, max_tools=MAX_TOOLS, max_cache_salt_chars=MAX_CACHE_SALT_CHARS))
        limits.MergeFrom(pb.Limits(**self.limits.reported()))
        return pb.ModelInfo(name=info.name, architecture=info.architecture, num_layers=info.num_layers,
                            num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                            max_context=info.max_context, vocab_size=info.vocab_size,
                            eos_token_ids=list(info.eos_token_ids), dtype=info.dtype, device=info.device,
                            backend=info.backend,
                            default_method=wire.method_message(default.name, describe_method(default)),
                            methods=serving_method_names(), limits=limits, server_version=self.version,
                            default_sampling=wire.sampling_message(info.sampling_defaults),
                            default_sampling_source=info.sampling_source, weight_format=info.weight_format,
                            weight_bytes=info.weight_bytes, kv_dtype=info.kv_dtype)
