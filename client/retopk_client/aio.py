"""The asyncio client: the same calls as ``Client``, awaited; ``generate`` is an async iterator.

    async with AsyncClient("localhost:50051") as client:
        async for chunk in client.generate("What is the capital of France?"):
            print(chunk.text, end="")
        async with client.session(method="retopk") as s:
            await s.complete("Hello")
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from retopk_client import _requests
from retopk_client.channel import DEFAULT, ClientConfig
from retopk_client.connection import HEALTH, Connection
from retopk_client.errors import NotFound, RetopkError, from_rpc_error
from retopk_client.health import HealthCheckRequest, status_name
from retopk_client.retry import Attempts, RetryPolicy, acall_with_retry
from retopk_client.transcript import REPLAYABLE, Transcript, materialized
from retopk_client.types import (
    Chunk,
    Completion,
    CompletionBuilder,
    ModelInfo,
    ServerStatus,
    SessionInfo,
    Tokenized,
    completions_of,
)
from retopk_proto.retopk.v1 import retopk_pb2 as pb


class AsyncGenerateStream:
    """The chunks of one Generate call as an async iterator; retried only before its first chunk."""

    def __init__(self, start, policy: RetryPolicy, timeout: float | None, sleep=asyncio.sleep, choices: int = 1,
                 follow=None) -> None:
        self._choices = max(1, choices)  # the request's n: the stream ends after that many final chunks
        self._start = start  # start(timeout_left) -> grpc.aio.UnaryStreamCall
        self._attempts = Attempts(policy, timeout, follow)  # follow: a handoff notice (connection.py)
        self._sleep = sleep
        self._received = 0
        self._done = False
        self._call = start(timeout)

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> Chunk:
        while True:
            if self._done:
                raise StopAsyncIteration
            try:
                msg = await self._call.read()
            except grpc.RpcError as rpc_err:
                err = from_rpc_error(rpc_err)
                if self._received == 0 and await self._retry(err):
                    continue
                self._done = True
                raise err from None
            if msg is grpc.aio.EOF:
                self._done = True
                raise StopAsyncIteration
            self._received += 1
            chunk = Chunk.from_proto(msg)
            if chunk.is_final:
                self._choices -= 1
                self._done = self._choices == 0
            return chunk

    async def _retry(self, err: RetopkError) -> bool:
        """Before the first chunk only: back off and re-send when the policy allows it."""
        delay = self._attempts.delay_after(err)
        if delay is None:
            return False
        await self._sleep(delay)
        self._call = self._start(self._attempts.left())
        return True

    def cancel(self) -> None:
        """Stop the stream; the server frees the request's batch slot at its next step."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def complete(self) -> Completion:
        builder = CompletionBuilder()
        async for chunk in self:
            builder.add(chunk)
        return builder.build()

    async def completions(self) -> list[Completion]:
        """One Completion per choice of a request with n > 1, by index."""
        return completions_of([chunk async for chunk in self])

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncSession:
    """A session as an async context manager: created on entry (or by ``open()``), closed on exit.
    ``replay=True``: continue in a new session when this one's replica is gone (see ``client.Session``)."""

    def __init__(self, client: AsyncClient, method=None, session_id: str | None = None, replay: bool = False) -> None:
        self._client = client
        self._method = method
        self._requested_id = session_id
        self.info: SessionInfo | None = None
        self.closed = False
        self.transcript = Transcript() if replay else None
        self.replays = 0

    @property
    def id(self) -> str:
        if self.info is None:
            raise RuntimeError("the session is not open yet: use 'async with' or 'await session.open()'")
        return self.info.session_id

    async def open(self) -> AsyncSession:
        if self.info is None:
            self.info = await self._client.create_session(self._method, session_id=self._requested_id)
        return self

    def generate(self, prompt: str | None = None, **kwargs: Any) -> AsyncGenerateStream | AsyncIterator[Chunk]:
        if self.transcript is None:
            return self._client.generate(prompt, session_id=self.id, **kwargs)
        return self._replaying_stream(prompt, materialized(kwargs))

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        if self.transcript is None:
            return await self._client.complete(prompt, session_id=self.id, **kwargs)
        builder = CompletionBuilder()
        async for chunk in self._replaying_stream(prompt, materialized(kwargs)):
            builder.add(chunk)
        return builder.build()

    async def _replaying_stream(self, prompt: str | None, kwargs: dict[str, Any]) -> AsyncIterator[Chunk]:
        builder, stream = CompletionBuilder(), self._client.generate(prompt, session_id=self.id, **kwargs)
        try:
            first = await anext(stream, None)
        except REPLAYABLE as err:
            replayed_prompt, replayed = self.transcript.replay_input(prompt, kwargs, err)
            self.info = await self._client.create_session(self.info.method)
            self.replays += 1
            stream = self._client.generate(replayed_prompt, session_id=self.id, **replayed)
            first = await anext(stream, None)
        async with stream:  # leaving (or aclose() of this generator) cancels the call
            if first is not None:
                builder.add(first)
                yield first
            async for chunk in stream:
                builder.add(chunk)
                yield chunk
        self.transcript.record(prompt, kwargs, builder.build())

    async def refresh(self) -> SessionInfo:
        self.info = await self._client.get_session(self.id)
        return self.info

    async def close(self) -> SessionInfo | None:
        if self.closed or self.info is None:
            return None
        self.closed = True
        try:
            return await self._client.close_session(self.id)
        except NotFound:
            return None

    async def __aenter__(self) -> AsyncSession:
        return await self.open()

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncClient:
    """asyncio retopk client over one ``grpc.aio`` channel; create and use it inside one event loop."""

    def __init__(
        self,
        address: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        config: ClientConfig | None = None,
        channel: grpc.aio.Channel | None = None,
        tls: bool = False,
        ca: str | os.PathLike | None = None,
        cert: str | os.PathLike | None = None,
        key: str | os.PathLike | None = None,
        handoff_addresses=(),
        follow_any_handoff: bool = False,
    ) -> None:
        config = config or ClientConfig.of(address, api_key=api_key, timeout=timeout, retry=retry, tls=tls, ca=ca,
                                           cert=cert, key=key, handoff_addresses=handoff_addresses,
                                           follow_any_handoff=follow_any_handoff)
        self._conn = Connection(config, grpc.aio, channel)

    @property
    def config(self) -> ClientConfig:
        """See ``Client.config``."""
        return self._conn.config

    async def close(self) -> None:
        for channel in self._conn.owned:
            await channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, rpc: str, request, timeout, idempotent: bool = True, session_id: str | None = None):
        """See ``Client._unary``."""
        timeout = self.config.call_timeout(timeout)
        policy = self.config.retry if idempotent else RetryPolicy(max_attempts=1)
        metadata = self.config.metadata(session_id)
        return await acall_with_retry(lambda left: self._conn.rpc(rpc)(request, timeout=left, metadata=metadata),
                                      policy, timeout, follow=self._conn.follow if session_id else None)

    def generate(self, prompt: str | None = None, *, timeout: float | None | object = DEFAULT,
                 **kwargs: Any) -> AsyncGenerateStream:
        """Stream a completion (same arguments as ``Client.generate``); iterate with ``async for``."""
        prefix_key = kwargs.pop("prefix_key", None)
        request = _requests.generate_request(prompt, **kwargs)
        metadata = self.config.metadata(kwargs.get("session_id"), prefix_key)
        return AsyncGenerateStream(
            lambda left: self._conn.rpc("Generate")(request, timeout=left, metadata=metadata),
            self.config.retry,
            self.config.call_timeout(timeout),
            choices=request.n or 1,
            follow=self._conn.follow if kwargs.get("session_id") else None,
        )

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        async with self.generate(prompt, **kwargs) as stream:
            return await stream.complete()

    async def create_session(self, method=None, *, session_id: str | None = None,
                             timeout: float | None | object = DEFAULT) -> SessionInfo:
        session_id = _requests.new_session_id() if session_id is None else session_id  # see Client.create_session
        req = _requests.create_session_request(method, session_id)
        return SessionInfo.from_proto(await self._unary("CreateSession", req, timeout, idempotent=False,
                                                        session_id=session_id))

    def session(self, method=None, *, session_id: str | None = None, replay: bool = False) -> AsyncSession:
        """A session opened on ``async with`` entry and closed on exit (``replay``: see ``AsyncSession``)."""
        return AsyncSession(self, method, session_id, replay)

    async def get_session(self, session_id: str, *, timeout: float | None | object = DEFAULT) -> SessionInfo:
        req = pb.GetSessionRequest(session_id=session_id)
        return SessionInfo.from_proto(await self._unary("GetSession", req, timeout, session_id=session_id))

    async def list_sessions(self, *, timeout: float | None | object = DEFAULT) -> list[SessionInfo]:
        resp = await self._unary("ListSessions", pb.ListSessionsRequest(), timeout)
        return [SessionInfo.from_proto(s) for s in resp.sessions]

    async def close_session(self, session_id: str, *, timeout: float | None | object = DEFAULT) -> SessionInfo:
        req = pb.CloseSessionRequest(session_id=session_id)
        reply = await self._unary("CloseSession", req, timeout, session_id=session_id)
        return SessionInfo.from_proto(reply.session)

    async def export_session(self, session_id: str, *, close: bool = False,
                             timeout: float | None | object = DEFAULT) -> bytes:
        """See ``Client.export_session``."""
        req = pb.ExportSessionRequest(session_id=session_id, close=close)
        try:
            call = self._conn.rpc("ExportSession")(req, timeout=self.config.call_timeout(timeout),
                                            metadata=self.config.metadata(session_id))
            return b"".join([chunk.data async for chunk in call])
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    async def import_session(self, artifact: bytes, *, session_id: str | None = None,
                             timeout: float | None | object = DEFAULT) -> SessionInfo:
        """See ``Client.import_session``."""
        try:
            reply = await self._conn.rpc("ImportSession")(iter(_requests.import_session_requests(artifact, session_id)),
                                                   timeout=self.config.call_timeout(timeout),
                                                   metadata=self.config.metadata(session_id))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        return SessionInfo.from_proto(reply)

    async def tokenize(self, text: str | None = None, *, messages=None,
                       timeout: float | None | object = DEFAULT) -> Tokenized:
        req = _requests.tokenize_request(text, messages)
        return Tokenized.from_proto(await self._unary("Tokenize", req, timeout))

    async def detokenize(self, token_ids, *, skip_special_tokens: bool = False,
                         timeout: float | None | object = DEFAULT) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self._unary("Detokenize", req, timeout)).text

    async def model_info(self, *, timeout: float | None | object = DEFAULT) -> ModelInfo:
        return ModelInfo.from_proto(await self._unary("GetModelInfo", pb.GetModelInfoRequest(), timeout))

    async def server_status(self, *, timeout: float | None | object = DEFAULT) -> ServerStatus:
        msg = await self._unary("GetServerStatus", pb.GetServerStatusRequest(), timeout)
        return ServerStatus.from_proto(msg)

    async def health(self, service: str = "", *, timeout: float | None | object = DEFAULT) -> str:
        return status_name(await self._unary(HEALTH, HealthCheckRequest(service=service), timeout))
