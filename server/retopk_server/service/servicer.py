"""The asyncio servicer of retopk.v1.ReTopKService: the gRPC wire over the Gateway (service/gateway.py).

It reads what gRPC carries (the invocation metadata, the deadline, the messages) and hands it to the Gateway,
which checks the caller, validates and submits; a CallError ends the rpc with its status.

Status codes: INVALID_ARGUMENT (bad input, message names the field), NOT_FOUND (unknown session),
ALREADY_EXISTS (session id in use), FAILED_PRECONDITION (session busy), RESOURCE_EXHAUSTED (queue
full, too many sessions), UNAVAILABLE (draining), DEADLINE_EXCEEDED, UNAUTHENTICATED (API key).

Tenancy: ``authorization: Bearer <key>`` names the caller (service/auth.py's KeyRing; no keys
configured: everyone is the anonymous owner). Session rpcs act on the caller's own sessions only
(another key's session id is NOT_FOUND, exactly as an unknown one; ListSessions lists the caller's
own); the caller's limits bound its concurrent streams (service/quota.py) and open sessions.
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.engine import session_artifact, session_file
from retopk_server.service import wire
from retopk_server.service.auth import Caller
from retopk_server.service.gateway import PEER, CallError, Gateway, Metadata
from retopk_server.service.wire import InvalidArgument

# A client's own deadline timer may fire (and cancel the stream) a moment before the server's copy of that
# deadline does: a cancellation this close to the deadline is the deadline's.
DEADLINE_SLACK_S = 0.1


def _cancelled_code(context: grpc.aio.ServicerContext) -> str:
    """The status a cancelled rpc's client received: DEADLINE_EXCEEDED when its deadline has passed (gRPC
    cancels the handler then too), else CANCELLED (the client went away)."""
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


def _metadata(context: grpc.aio.ServicerContext) -> Metadata:
    return tuple(context.invocation_metadata() or ())


def _unary(method, peer: bool = False):
    """Auth, error mapping and the call's metrics around a unary rpc.

    The rpc method gets the authenticated Caller as its third argument; with ``peer`` that may be PEER, a
    replica presenting the shared peer key (``Gateway.authenticate``).
    """
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: ReTopKServicer, request, context: grpc.aio.ServicerContext):
        call = self.gateway.call(name)
        try:
            caller = self.gateway.authenticate(_metadata(context), peer)
            return await method(self, request, context, caller)
        except BaseException as exc:  # every error becomes a status; a cancellation goes on
            if (error := call.stopped(exc, _cancelled_code(context))) is None:
                raise
            await context.abort(error.grpc_status, error.message, error.trailers)
        finally:
            call.end()

    return wrapper


class ReTopKServicer(pb_grpc.ReTopKServiceServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.engine = gateway.engine

    def _check_affinity(self, context, session_id: str | None) -> None:
        self.gateway.check_affinity(_metadata(context), session_id)

    async def _engine(self, future):
        return await asyncio.wrap_future(future)

    # ------------------------------------------------------------------------------------ Generate
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        call = self.gateway.call("Generate")
        try:
            metadata = _metadata(context)
            caller = self.gateway.authenticate(metadata)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            generation = await self.gateway.generate(call, caller, request, metadata, deadline)
        except BaseException as exc:  # refused before the engine took it, or the client went away meanwhile
            if (error := call.stopped(exc, _cancelled_code(context))) is None:
                raise
            await context.abort(error.grpc_status, error.message, error.trailers)
        cancelled = "CANCELLED"
        try:
            async for response in generation:
                yield response
        except CallError as error:  # the engine ended it (and reported it to the observer)
            await context.abort(error.grpc_status, error.message, error.trailers)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away or the deadline passed
            # gRPC ends the handler either way: the task cancelled, or this generator closed at its yield.
            cancelled = _cancelled_code(context)
            raise
        finally:
            generation.close(cancelled)

    # ------------------------------------------------------------------------------------ sessions
    @_unary
    async def CreateSession(self, request: pb.CreateSessionRequest, context, caller: Caller) -> pb.SessionInfo:
        session_id = wire.identifier("session_id", request.session_id) if request.HasField("session_id") else None
        self._check_affinity(context, session_id)
        info = self.engine.info
        method = wire.method_spec(request.method, info.default_method, info) if request.HasField("method") else None
        return wire.session_info(await self._engine(self.engine.commands.create_session(
            session_id, method, caller.name, caller.max_sessions)))

    @_unary
    async def GetSession(self, request: pb.GetSessionRequest, context, caller: Caller) -> pb.SessionInfo:
        session_id = wire.identifier("session_id", request.session_id)
        self._check_affinity(context, session_id)
        await self.gateway.check_moved(caller, session_id)
        await self.gateway.restore_saved(caller, session_id)
        return wire.session_info(await self._engine(self.engine.commands.get_session(session_id, caller.name)))

    @_unary
    async def ListSessions(self, request: pb.ListSessionsRequest, context, caller: Caller) -> pb.ListSessionsResponse:
        sessions = await self._engine(self.engine.commands.list_sessions(caller.name))
        return pb.ListSessionsResponse(sessions=[wire.session_info(s) for s in sessions])

    @_unary
    async def CloseSession(self, request: pb.CloseSessionRequest, context, caller: Caller) -> pb.CloseSessionResponse:
        session_id = wire.identifier("session_id", request.session_id)
        self._check_affinity(context, session_id)
        await self.gateway.check_moved(caller, session_id)
        await self.gateway.restore_saved(caller, session_id)
        snapshot = await self._engine(self.engine.commands.close_session(session_id, caller.name))
        return pb.CloseSessionResponse(session=wire.session_info(snapshot))

    # ------------------------------------------------------------------------------------ session artifacts
    async def ExportSession(self, request: pb.ExportSessionRequest, context: grpc.aio.ServicerContext):
        """The caller's idle session as artifact chunks (engine/session_artifact.py)."""
        call = self.gateway.call("ExportSession")
        try:
            caller = self.gateway.authenticate(_metadata(context))
            session_id = wire.identifier("session_id", request.session_id)
            self._check_affinity(context, session_id)
            await self.gateway.check_moved(caller, session_id)
            await self.gateway.restore_saved(caller, session_id)
            artifact = await self._engine(self.engine.commands.export_session(session_id, caller.name,
                                                                              request.close))
            parts = await asyncio.to_thread(session_file.parts, artifact)
        except BaseException as exc:  # every error becomes a status; a cancellation goes on
            if (error := call.stopped(exc, _cancelled_code(context))) is None:
                raise
            await context.abort(error.grpc_status, error.message, error.trailers)
        try:
            for chunk in session_artifact.chunks(parts, self.gateway.limits.max_session_chunk_bytes):
                yield pb.SessionChunk(data=bytes(chunk))
        except asyncio.CancelledError:
            call.code = _cancelled_code(context)
            raise
        finally:
            call.end()

    @functools.partial(_unary, peer=True)
    async def ImportSession(self, request_iterator, context, caller: Caller) -> pb.SessionInfo:
        """Read the artifact's chunks as they arrive (each and all bounded; session_file.Receiver checks the sizes
        it states on the way), check and parse it off the engine thread, open the session."""
        total, session_id, first = 0, None, True
        limit, step = self.gateway.limits.max_session_artifact_bytes, self.gateway.limits.max_session_chunk_bytes
        reader = session_file.Receiver(limit)
        try:
            try:
                async for message in request_iterator:
                    data = message.data  # each read of the field is a copy of its bytes
                    if len(data) > step:
                        raise InvalidArgument("data", f"a chunk holds at most {step} bytes (ModelInfo.limits."
                                                      f"max_session_chunk_bytes), got {len(data)}")
                    if message.HasField("session_id"):
                        if not first:
                            raise InvalidArgument("session_id", "set it in the first message only")
                        session_id = wire.identifier("session_id", message.session_id)
                    first = False
                    total += len(data)
                    if total > limit:
                        raise session_artifact.too_large(limit)
                    reader.feed(data)
            except BaseException:
                reader.close()  # refused, or the stream ended early: what came goes now
                raise
            artifact = await asyncio.to_thread(reader.finish)  # which closes it
        except session_artifact.UnsupportedFormat as e:
            raise CallError("FAILED_PRECONDITION", str(e)) from None
        except session_artifact.ArtifactError as e:
            raise InvalidArgument(e.field, str(e).removeprefix(f"{e.field}: ")) from None
        session_id = session_id or wire.identifier("session_id", artifact.session_id)
        self._check_affinity(context, session_id)
        owner, max_owned = caller.name, caller.max_sessions
        if caller is PEER:  # a replica hands it over for its owner, within the owner's session limit
            owner = artifact.owner
            known = self.gateway.keys.caller(owner)
            max_owned = known.max_sessions if known is not None else None
        await asyncio.to_thread(self.engine.check_artifact, artifact, owner)  # not on the engine thread
        snapshot = await self._engine(self.engine.commands.import_session(artifact, owner, session_id, max_owned,
                                                                          checked=True))
        return wire.session_info(snapshot)

    # ------------------------------------------------------------------------------------ tokenizer
    @_unary
    async def Tokenize(self, request: pb.TokenizeRequest, context, _caller: Caller) -> pb.TokenizeResponse:
        which = request.WhichOneof("input")
        if which is None:
            raise InvalidArgument("input", "set one of text, chat")
        self.gateway.limits.tokenize(request)
        if which == "text":
            ids = await self._engine(self.engine.commands.encode(request.text))
        else:
            ids = await self._engine(self.engine.commands.encode_chat(wire.chat_messages(request.chat)))
        pieces = await self._engine(self.engine.commands.token_pieces(ids))
        return pb.TokenizeResponse(token_ids=ids, tokens=[str(p) for p in pieces])

    @_unary
    async def Detokenize(self, request: pb.DetokenizeRequest, context, _caller: Caller) -> pb.DetokenizeResponse:
        self.gateway.limits.detokenize(request)
        ids = wire.check_token_ids("token_ids", request.token_ids, self.engine.info.vocab_size)
        text = await self._engine(self.engine.commands.detokenize(ids, request.skip_special_tokens))
        return pb.DetokenizeResponse(text=text)

    # ------------------------------------------------------------------------------------ model, status
    @_unary
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context, _caller: Caller) -> pb.ModelInfo:
        return self.gateway.model_info()

    @_unary
    async def GetServerStatus(self, request: pb.GetServerStatusRequest, context, _caller: Caller) -> pb.ServerStatus:
        return wire.server_status(await self._engine(self.engine.commands.status()))
