"""The asyncio servicer of retopk.v1.ReTopKService: checks the caller, validates, hands work to the engine.

Status codes: INVALID_ARGUMENT (bad input, message names the field), NOT_FOUND (unknown session),
ALREADY_EXISTS (session id in use), FAILED_PRECONDITION (session busy), RESOURCE_EXHAUSTED (queue
full, too many sessions), UNAVAILABLE (draining), DEADLINE_EXCEEDED, UNAUTHENTICATED (API key).

Session affinity: a router keeps a session on its replica by hashing the gRPC metadata
``x-session-id`` (SESSION_METADATA), which clients send on every rpc that names a session. When that
metadata is present it must equal the session the body names (and a body must name one), else
INVALID_ARGUMENT: a request routed by one id must not act on another session.

Tenancy: ``authorization: Bearer <key>`` names the caller (service/auth.py's KeyRing; no keys
configured: everyone is the anonymous owner). Session rpcs act on the caller's own sessions only
(another key's session id is NOT_FOUND, exactly as an unknown one; ListSessions lists the caller's
own); the caller's limits bound its concurrent streams (service/quota.py) and open sessions.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time

import grpc

from retopk_core.methods.registry import serving_method_names
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.config import ServerConfig
from retopk_server.engine import Engine, EngineError, EngineObserver, RequestStream, describe_method, session_artifact
from retopk_server.engine.requests import MAX_N, MAX_TOOLS, MAX_TOP_LOGPROBS, ErrorCode
from retopk_server.engine.session_store import SessionStore
from retopk_server.runtime.constraints import ConstraintError
from retopk_server.runtime.prefix_cache import MAX_CACHE_SALT_CHARS
from retopk_server.service import convert
from retopk_server.service.auth import Caller, KeyRing, Unauthenticated
from retopk_server.service.convert import InvalidArgument
from retopk_server.service.handoff_notices import NOTICE_METADATA, HandoffNotices
from retopk_server.service.limits import InputLimits
from retopk_server.service.quota import StreamQuota, TooManyStreams
from retopk_server.service.saved_sessions import SavedSessions
from retopk_shared.metadata import AUTHORIZATION, SESSION_METADATA

log = logging.getLogger("retopk_server.service")

PEER_METADATA = "x-retopk-peer-key"  # a replica handing a session over presents the servers' shared peer_key
PEER = Caller("")  # such a replica: ImportSession then opens the session as its artifact's owner


class Fail(Exception):
    """End the rpc with this status (and these trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


def _fail_from(exc: Exception) -> Fail:
    if isinstance(exc, Fail):
        return exc
    if isinstance(exc, InvalidArgument):
        return Fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, Unauthenticated):
        return Fail(grpc.StatusCode.UNAUTHENTICATED, str(exc))
    if isinstance(exc, TooManyStreams):
        return Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, EngineError):
        return Fail(grpc.StatusCode[exc.code.value], exc.message)
    log.exception("internal error", exc_info=exc)
    return Fail(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


# A client's own deadline timer may fire (and cancel the stream) a moment before the server's copy of that
# deadline does: a cancellation this close to the deadline is the deadline's.
DEADLINE_SLACK_S = 0.1


def _cancelled_code(context) -> str:
    """The status a cancelled rpc's client received: DEADLINE_EXCEEDED when its deadline has passed (gRPC
    cancels the handler then too), else CANCELLED (the client went away)."""
    try:
        remaining = context.time_remaining()
    except Exception:  # noqa: BLE001 - a context without deadlines (the HTTP front's)
        remaining = None
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


def _unary(method, peer: bool = False):
    """Auth, error mapping and the observer's on_rpc / on_error around a unary rpc.

    The rpc method gets the authenticated Caller as its third argument; with ``peer`` that may be PEER, a
    replica presenting the shared peer key (``authenticate``).
    """
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: ReTopKServicer, request, context: grpc.aio.ServicerContext):
        t0, code = time.monotonic(), "OK"
        try:
            caller = self.authenticate(context, peer)
            return await method(self, request, context, caller)
        except asyncio.CancelledError:
            code = _cancelled_code(context)
            raise
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            fail = _fail_from(exc)
            code = fail.code.name
            self._hook("on_error", None, code)
            await context.abort(fail.code, fail.message, fail.trailers)
        finally:
            self._hook("on_rpc", name, code, time.monotonic() - t0)

    return wrapper


class ReTopKServicer(pb_grpc.ReTopKServiceServicer):
    def __init__(self, engine: Engine, config: ServerConfig, observer: EngineObserver | None = None,
                 version: str = "", keys: KeyRing | None = None, store: SessionStore | None = None) -> None:
        self.engine = engine
        self.config = config
        self.observer = observer or engine.observer
        self.version = version
        self.keys = keys if keys is not None else KeyRing.from_config(config)
        self.streams = StreamQuota()
        self.store = store  # --session-dir (engine/session_store.py) or None
        self.saved = SavedSessions(store, engine, self.limits.max_session_artifact_bytes,
                                   self.keys.caller) if store else None
        self.notices = HandoffNotices()  # sessions a lingering drain handed over (service/handoff.py)
        self._live: set[RequestStream] = set()  # the Generate streams under way

    def cut_streams(self) -> int:
        """End every Generate under way with UNAVAILABLE, as a drain's grace ends (the engine drops each as a
        cancelled request, so its session keeps what the client was sent) -> how many."""
        cut = list(self._live)
        for stream in cut:
            stream.cut(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; the drain grace is over"))
        return len(cut)

    def _check_moved(self, caller: Caller, session_id: str | None) -> None:
        """A session this draining server handed over: UNAVAILABLE, for its owner with the trailer naming its new
        home (service/handoff.py)."""
        address = self.notices.where(caller.name, session_id)
        if address is not None:
            raise Fail(grpc.StatusCode.UNAVAILABLE, f"session_id: session {session_id!r} moved to {address} (this "
                       "server is draining); continue there", ((NOTICE_METADATA, address),))

    def _hook(self, name: str, *args) -> None:
        try:
            getattr(self.observer, name)(*args)
        except Exception:
            log.exception("observer hook %s failed", name)

    def authenticate(self, context, peer: bool = False) -> Caller:
        """The caller of this rpc (KeyRing.identify); Unauthenticated without a known key. With ``peer``, a
        replica that presents the servers' shared ``peer_key`` (PEER_METADATA) is PEER: it hands sessions over
        on behalf of their owners (service/handoff.py)."""
        metadata = context.invocation_metadata() or ()
        if peer and self.config.peer_key is not None:
            sent = [v for k, v in metadata if k == PEER_METADATA]
            if len(sent) == 1 and hmac.compare_digest(sent[0].encode(), self.config.peer_key.encode()):
                return PEER
        sent = [v for k, v in metadata if k == AUTHORIZATION]
        return self.keys.identify(sent[0] if len(sent) == 1 else None)

    async def _restore_saved(self, caller: Caller, session_id: str | None) -> None:
        """A session an earlier server saved in --session-dir comes back before its first use
        (service/saved_sessions.py)."""
        if self.saved is not None and session_id is not None:
            await self.saved.restore(caller.name, session_id, caller.max_sessions)

    def _check_affinity(self, context, session_id: str | None) -> None:
        """The x-session-id metadata, when sent, must name the body's session (``session_id``)."""
        sent = [v for k, v in (context.invocation_metadata() or ()) if k == SESSION_METADATA]
        if not sent:
            return
        if len(sent) > 1 or sent[0] != session_id:
            body = f"session_id {session_id!r}" if session_id else "no session_id"
            raise InvalidArgument(SESSION_METADATA, f"metadata {', '.join(map(repr, sent))} does not match the "
                                  f"request, which names {body}; send the session's id (or no {SESSION_METADATA})")

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

    async def _engine(self, future):
        return await asyncio.wrap_future(future)

    @functools.cached_property
    def limits(self) -> InputLimits:
        """The input sizes a caller may send (service/limits.py), from the config and the loaded model."""
        return InputLimits.of(self.config, self.engine.info)

    # ------------------------------------------------------------------------------------ Generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        t0, code = time.monotonic(), "OK"
        stream = caller = None
        try:
            caller = self.authenticate(context)
            self.streams.acquire(caller)
        except Exception as exc:  # noqa: BLE001 - refused before anything was counted
            caller = None
            fail = _fail_from(exc)
            self._hook("on_error", None, fail.code.name)
            self._hook("on_rpc", "Generate", fail.code.name, time.monotonic() - t0)
            await context.abort(fail.code, fail.message)
        try:
            self._check_affinity(context, request.session_id if request.HasField("session_id") else None)
            self._check_moved(caller, request.session_id if request.HasField("session_id") else None)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            info = self.engine.info
            self.limits.generate(request)
            spec = convert.generation_request(request, info.default_method, info.vocab_size,
                                              self.config.max_new_tokens, deadline, info.sampling_defaults,
                                              self.engine.config.constraints)
            spec.owner = caller.name
            await self._restore_saved(caller, spec.session_id)
            self.limits.method(spec.method)
            if spec.constraint is not None:  # compiled off the engine thread (cached by content)
                spec.grammar = await self._compile(spec.constraint, convert.tool_constraints(spec))
            stream = RequestStream()
            self.engine.submit(spec, stream)
            self._live.add(stream)
        except Exception as exc:  # noqa: BLE001 - refused before the engine took it
            self.streams.release(caller)
            fail = _fail_from(exc)
            code = fail.code.name
            self._hook("on_error", None, code)
            self._hook("on_rpc", "Generate", code, time.monotonic() - t0)
            await context.abort(fail.code, fail.message, fail.trailers)
        final_sent = False
        try:
            async for event in stream:
                response = convert.generate_response(event, spec.request_id)
                final_sent = event.finish_reason is not None
                yield response
        except EngineError as exc:  # the engine already reported it to the observer
            code = exc.code.value
            await context.abort(grpc.StatusCode[exc.code.value], exc.message)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away or the deadline passed
            # What the client received: a client that stops reading once it has the last response (the SDK's
            # complete()) got every token and its status is OK; otherwise a deadline or a cancellation. gRPC
            # ends the handler either way: the task cancelled, or this generator closed at its yield.
            code = "OK" if final_sent else _cancelled_code(context)
            raise
        finally:
            stream.cancel()  # no-op when finished; otherwise the engine drops it at the next step
            self._live.discard(stream)
            self.streams.release(caller)
            self._hook("on_rpc", "Generate", code, time.monotonic() - t0)

    # ------------------------------------------------------------------------------------ sessions
    @_unary
    async def CreateSession(self, request: pb.CreateSessionRequest, context, caller: Caller) -> pb.SessionInfo:
        session_id = convert.identifier("session_id", request.session_id) if request.HasField("session_id") else None
        self._check_affinity(context, session_id)
        method = (convert.method_spec(request.method, self.engine.info.default_method)
                  if request.HasField("method") else None)
        self.limits.method(method)
        return convert.session_info(await self._engine(self.engine.commands.create_session(
            session_id, method, caller.name, caller.max_sessions)))

    @_unary
    async def GetSession(self, request: pb.GetSessionRequest, context, caller: Caller) -> pb.SessionInfo:
        session_id = convert.identifier("session_id", request.session_id)
        self._check_affinity(context, session_id)
        self._check_moved(caller, session_id)
        await self._restore_saved(caller, session_id)
        return convert.session_info(await self._engine(self.engine.commands.get_session(session_id, caller.name)))

    @_unary
    async def ListSessions(self, request: pb.ListSessionsRequest, context, caller: Caller) -> pb.ListSessionsResponse:
        sessions = await self._engine(self.engine.commands.list_sessions(caller.name))
        return pb.ListSessionsResponse(sessions=[convert.session_info(s) for s in sessions])

    @_unary
    async def CloseSession(self, request: pb.CloseSessionRequest, context, caller: Caller) -> pb.CloseSessionResponse:
        session_id = convert.identifier("session_id", request.session_id)
        self._check_affinity(context, session_id)
        self._check_moved(caller, session_id)
        await self._restore_saved(caller, session_id)
        snapshot = await self._engine(self.engine.commands.close_session(session_id, caller.name))
        return pb.CloseSessionResponse(session=convert.session_info(snapshot))

    # ------------------------------------------------------------------------------------ session artifacts
    async def ExportSession(self, request: pb.ExportSessionRequest, context: grpc.aio.ServicerContext):
        """The caller's idle session as artifact chunks (engine/session_artifact.py)."""
        t0, code = time.monotonic(), "OK"
        try:
            caller = self.authenticate(context)
            session_id = convert.identifier("session_id", request.session_id)
            self._check_affinity(context, session_id)
            self._check_moved(caller, session_id)
            await self._restore_saved(caller, session_id)
            artifact = await self._engine(self.engine.commands.export_session(session_id, caller.name,
                                                                              request.close))
            parts = await asyncio.to_thread(session_artifact.encode_parts, artifact)
        except Exception as exc:  # noqa: BLE001 - every error becomes a status
            fail = _fail_from(exc)
            code = fail.code.name
            self._hook("on_error", None, code)
            self._hook("on_rpc", "ExportSession", code, time.monotonic() - t0)
            await context.abort(fail.code, fail.message, fail.trailers)
        try:
            for chunk in session_artifact.chunks(parts, self.limits.max_session_chunk_bytes):
                yield pb.SessionChunk(data=chunk)
        except asyncio.CancelledError:
            code = _cancelled_code(context)
            raise
        finally:
            self._hook("on_rpc", "ExportSession", code, time.monotonic() - t0)

    @functools.partial(_unary, peer=True)
    async def ImportSession(self, request_iterator, context, caller: Caller) -> pb.SessionInfo:
        """Read the artifact's chunks as they arrive (each and all bounded; ArtifactReader checks the header and
        hashes the payload on the way), parse it off the engine thread, open the session."""
        total, session_id, first = 0, None, True
        limit, step = self.limits.max_session_artifact_bytes, self.limits.max_session_chunk_bytes
        reader = session_artifact.ArtifactReader(limit)
        try:
            async for message in request_iterator:
                if len(message.data) > step:
                    raise InvalidArgument("data", f"a chunk holds at most {step} bytes (ModelInfo.limits."
                                                  f"max_session_chunk_bytes), got {len(message.data)}")
                if message.HasField("session_id"):
                    if not first:
                        raise InvalidArgument("session_id", "set it in the first message only")
                    session_id = convert.identifier("session_id", message.session_id)
                first = False
                total += len(message.data)
                if total > limit:
                    raise InvalidArgument("data", f"the artifact exceeds {limit} bytes "
                                                  "(ModelInfo.limits.max_session_artifact_bytes)")
                reader.feed(message.data)
            artifact = await asyncio.to_thread(reader.finish)
        except session_artifact.UnsupportedFormat as e:
            raise Fail(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from None
        except session_artifact.ArtifactError as e:
            raise InvalidArgument(e.field, str(e).removeprefix(f"{e.field}: ")) from None
        session_id = session_id or convert.identifier("session_id", artifact.session_id)
        self._check_affinity(context, session_id)
        owner, max_owned = caller.name, caller.max_sessions
        if caller is PEER:  # a replica hands it over for its owner, within the owner's session limit
            owner = artifact.owner
            known = self.keys.caller(owner)
            max_owned = known.max_sessions if known is not None else None
        snapshot = await self._engine(self.engine.commands.import_session(artifact, owner, session_id, max_owned))
        return convert.session_info(snapshot)

    # ------------------------------------------------------------------------------------ tokenizer
    @_unary
    async def Tokenize(self, request: pb.TokenizeRequest, context, _caller: Caller) -> pb.TokenizeResponse:
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidArgument("input", "set one of text, chat")
        self.limits.tokenize(request)
        if which == "text":
            ids = await self._engine(self.engine.commands.encode(request.text))
        else:
            ids = await self._engine(self.engine.commands.encode_chat(convert.chat_messages(request.chat)))
        pieces = await self._engine(self.engine.commands.token_pieces(ids))
        return pb.TokenizeResponse(token_ids=ids, tokens=[str(p) for p in pieces])

    @_unary
    async def Detokenize(self, request: pb.DetokenizeRequest, context, _caller: Caller) -> pb.DetokenizeResponse:
        self.limits.detokenize(request)
        ids = convert.check_token_ids("token_ids", request.token_ids, self.engine.info.vocab_size)
        text = await self._engine(self.engine.commands.detokenize(ids, request.skip_special_tokens))
        return pb.DetokenizeResponse(text=text)

    # ------------------------------------------------------------------------------------ model, status
    @_unary
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context, _caller: Caller) -> pb.ModelInfo:
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
                            default_method=convert.method_message(default.name, describe_method(default)),
                            methods=serving_method_names(), limits=limits, server_version=self.version,
                            default_sampling=convert.sampling_message(info.sampling_defaults),
                            default_sampling_source=info.sampling_source, weight_format=info.weight_format,
                            weight_bytes=info.weight_bytes, kv_dtype=info.kv_dtype)

    @_unary
    async def GetServerStatus(self, request: pb.GetServerStatusRequest, context, _caller: Caller) -> pb.ServerStatus:
        return convert.server_status(await self._engine(self.engine.commands.status()))
