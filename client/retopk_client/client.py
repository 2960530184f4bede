"""The synchronous client.

    with Client("localhost:50051") as client:
        for chunk in client.generate("What is the capital of France?", max_new_tokens=32):
            print(chunk.text, end="", flush=True)
        with client.session(method=Method.retopk(top_k=64)) as s:
            s.complete(messages=[{"role": "user", "content": "Hi"}])

Every failure raises a ``RetopkError`` subclass (retopk_client.errors). Idempotent calls retry
UNAVAILABLE with exponential backoff (``RetryPolicy``); ``generate`` retries only until its first
chunk has arrived, never once a stream has started.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from retopk_client import _requests
from retopk_client.channel import DEFAULT, ClientConfig
from retopk_client.connection import HEALTH, Connection
from retopk_client.errors import NotFound, RetopkError, from_rpc_error
from retopk_client.health import HealthCheckRequest, status_name
from retopk_client.retry import Attempts, RetryPolicy, call_with_retry
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


class GenerateStream:
    """The chunks of one Generate call, as an iterator; ``cancel()`` (or leaving a ``with``) stops it.

    A retryable error before the first chunk re-sends the request after a backoff; any error after
    it is raised as it is, since the server may already have generated (and appended to a session).
    """

    def __init__(self, start, policy: RetryPolicy, timeout: float | None, sleep=time.sleep, choices: int = 1,
                 follow=None) -> None:
        self._choices = max(1, choices)  # the request's n: the stream ends after that many final chunks
        self._start = start  # start(timeout_left) -> grpc response iterator (also a grpc.Call)
        self._attempts = Attempts(policy, timeout, follow)  # follow: a handoff notice (connection.py)
        self._sleep = sleep
        self._received = 0
        self._done = False
        self._call = start(timeout)

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        while True:
            if self._done:
                raise StopIteration
            try:
                msg = next(self._call)
            except StopIteration:
                self._done = True
                raise
            except grpc.RpcError as rpc_err:
                err = from_rpc_error(rpc_err)
                if self._received == 0 and self._retry(err):
                    continue
                self._done = True
                raise err from None
            self._received += 1
            chunk = Chunk.from_proto(msg)
            if chunk.is_final:
                self._choices -= 1
                self._done = self._choices == 0
            return chunk

    def _retry(self, err: RetopkError) -> bool:
        """Before the first chunk only: back off and re-send when the policy allows it."""
        delay = self._attempts.delay_after(err)
        if delay is None:
            return False
        self._sleep(delay)
        self._call = self._start(self._attempts.left())
        return True

    def cancel(self) -> None:
        """Stop the stream; the server frees the request's batch slot at its next step."""
        if not self._done:
            self._done = True
            self._call.cancel()

    def complete(self) -> Completion:
        """Read the rest of the stream into one Completion (a request with n = 1)."""
        builder = CompletionBuilder()
        for chunk in self:
            builder.add(chunk)
        return builder.build()

    def completions(self) -> list[Completion]:
        """Read the rest of the stream into one Completion per choice (a request with n > 1), by index."""
        return completions_of(self)

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class Session:
    """A server-side conversation: its KV and method caches persist between calls.

    Closed on leaving a ``with`` block (or by ``close()``); calls take the same arguments as the
    client's, without ``session_id`` and ``method`` (fixed at creation).

    With ``replay=True`` the session keeps its transcript on the client, and when a turn fails with
    NOT_FOUND or UNAVAILABLE before any token arrived (the replica holding it is gone), it opens a new
    session with the same method (a new id: ``id`` changes, ``replays`` counts) and sends the whole
    conversation plus that turn there (retopk_client.transcript). Off by default: the transcript costs
    client memory and the replayed turn re-prefills everything.
    """

    def __init__(self, client: Client, info: SessionInfo, replay: bool = False) -> None:
        self._client = client
        self.info = info
        self.closed = False
        self.transcript = Transcript() if replay else None
        self.replays = 0

    @property
    def id(self) -> str:
        return self.info.session_id

    def generate(self, prompt: str | None = None, **kwargs: Any) -> GenerateStream | Iterator[Chunk]:
        if self.transcript is None:
            return self._client.generate(prompt, session_id=self.id, **kwargs)
        return self._replaying_stream(prompt, materialized(kwargs))

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        if self.transcript is None:
            return self._client.complete(prompt, session_id=self.id, **kwargs)
        builder = CompletionBuilder()
        for chunk in self._replaying_stream(prompt, materialized(kwargs)):
            builder.add(chunk)
        return builder.build()

    def _replaying_stream(self, prompt: str | None, kwargs: dict[str, Any]) -> Iterator[Chunk]:
        builder, stream = CompletionBuilder(), self._client.generate(prompt, session_id=self.id, **kwargs)
        try:
            first = next(stream, None)
        except REPLAYABLE as err:
            replayed_prompt, replayed = self.transcript.replay_input(prompt, kwargs, err)
            self.info = self._client.create_session(self.info.method)
            self.replays += 1
            stream = self._client.generate(replayed_prompt, session_id=self.id, **replayed)
            first = next(stream, None)
        with stream:  # leaving (or close() of this generator) cancels the call
            if first is not None:
                builder.add(first)
                yield first
            for chunk in stream:
                builder.add(chunk)
                yield chunk
        self.transcript.record(prompt, kwargs, builder.build())

    def refresh(self) -> SessionInfo:
        self.info = self._client.get_session(self.id)
        return self.info

    def close(self) -> SessionInfo | None:
        """Close on the server; a session that is already gone is not an error here."""
        if self.closed:
            return None
        self.closed = True
        try:
            return self._client.close_session(self.id)
        except NotFound:
            return None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Client:
    """Synchronous retopk client over one gRPC channel (thread-safe, like the channel)."""

    def __init__(
        self,
        address: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        config: ClientConfig | None = None,
        channel: grpc.Channel | None = None,
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
        self._conn = Connection(config, grpc, channel)

    # ---- plumbing -------------------------------------------------------------------------

    @property
    def config(self) -> ClientConfig:
        """The client's settings; ``address`` is where calls go now (a followed handoff notice moves it)."""
        return self._conn.config

    def close(self) -> None:
        for channel in self._conn.owned:
            channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, rpc: str, request, timeout, idempotent: bool = True, session_id: str | None = None):
        """Call the unary rpc named ``rpc`` with the key's (and the session's) metadata, the deadline, (when
        idempotent) retries and (on a session) a handoff notice followed (connection.py)."""
        timeout = self.config.call_timeout(timeout)
        policy = self.config.retry if idempotent else RetryPolicy(max_attempts=1)
        metadata = self.config.metadata(session_id)
        return call_with_retry(lambda left: self._conn.rpc(rpc)(request, timeout=left, metadata=metadata), policy,
                               timeout, follow=self._conn.follow if session_id else None)

    # ---- generation -----------------------------------------------------------------------

    def generate(self, prompt: str | None = None, *, timeout: float | None | object = DEFAULT,
                 **kwargs: Any) -> GenerateStream:
        """Stream a completion; yields ``Chunk``s, the last one with finish reason, usage and timings.

        Input: ``prompt`` (text), or ``messages=[{"role", "content"}, ...]`` (chat template), or
        ``token_ids=[...]``. Options: ``session_id``, ``max_new_tokens``, ``sampling`` (a Sampling)
        or plain ``temperature=``, ``top_p=``, ``top_k=``, ``min_p=``, ``repetition_penalty=``,
        ``presence_penalty=``, ``frequency_penalty=``, ``seed=``; ``method`` (a Method, a name, or a
        mapping); ``stop``, ``stop_token_ids``, ``ignore_eos``, ``return_step_stats``, ``request_id``;
        ``logprobs=True`` (each chunk's ``logprobs``: a ``TokenLogprob`` per token id) and
        ``top_logprobs=N`` (the N most likely tokens of each step too; N <= ``ModelInfo.limits.max_top_logprobs``);
        ``constraint=Constraint.json_schema({...})`` (or ``json_object()``, ``regex(...)``, ``grammar(...)``);
        ``tools=[Tool(...) or OpenAI-style mappings]`` with ``tool_choice`` ("none", "auto", "required" or
        {"name": ...}; calls arrive in ``Chunk.tool_calls`` / ``Completion.tool_calls``); ``n`` choices of one
        prompt (chunks name their ``index``; ``stream.completions()`` gathers one Completion per choice);
        ``cache_salt`` (the prefix cache shares a prompt's start only among requests of one key and salt) and
        ``prefix_key`` (sent as ``x-prefix-key``: a router sends requests that name one shared prompt start to
        one replica, whose prefix cache then holds it; docs/deploy.md).
        Unset sampling fields take the server's defaults (``ModelInfo.default_sampling``); ``temperature=0``
        is greedy. ``timeout`` bounds the whole stream.
        """
        prefix_key = kwargs.pop("prefix_key", None)
        request = _requests.generate_request(prompt, **kwargs)
        metadata = self.config.metadata(kwargs.get("session_id"), prefix_key)
        return GenerateStream(
            lambda left: self._conn.rpc("Generate")(request, timeout=left, metadata=metadata),
            self.config.retry,
            self.config.call_timeout(timeout),
            choices=request.n or 1,
            follow=self._conn.follow if kwargs.get("session_id") else None,
        )

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run ``generate`` to the end and return the whole text, token ids, usage and timings."""
        with self.generate(prompt, **kwargs) as stream:
            return stream.complete()

    # ---- sessions -------------------------------------------------------------------------

    def create_session(self, method=None, *, session_id: str | None = None,
                       timeout: float | None | object = DEFAULT) -> SessionInfo:
        """Open a session (not retried: a lost reply could otherwise open two). Without ``session_id`` the
        client picks a random one, so that a router sees the session's affinity key from its first call."""
        session_id = _requests.new_session_id() if session_id is None else session_id
        req = _requests.create_session_request(method, session_id)
        return SessionInfo.from_proto(self._unary("CreateSession", req, timeout, idempotent=False,
                                                  session_id=session_id))

    def session(self, method=None, *, session_id: str | None = None, replay: bool = False,
                timeout: float | None | object = DEFAULT) -> Session:
        """Open a session now and return it; use it in a ``with`` block so that it is closed.
        ``replay=True``: continue in a new session when this one's replica is gone (see ``Session``)."""
        return Session(self, self.create_session(method, session_id=session_id, timeout=timeout), replay)

    def get_session(self, session_id: str, *, timeout: float | None | object = DEFAULT) -> SessionInfo:
        req = pb.GetSessionRequest(session_id=session_id)
        return SessionInfo.from_proto(self._unary("GetSession", req, timeout, session_id=session_id))

    def list_sessions(self, *, timeout: float | None | object = DEFAULT) -> list[SessionInfo]:
        resp = self._unary("ListSessions", pb.ListSessionsRequest(), timeout)
        return [SessionInfo.from_proto(s) for s in resp.sessions]

    def close_session(self, session_id: str, *, timeout: float | None | object = DEFAULT) -> SessionInfo:
        req = pb.CloseSessionRequest(session_id=session_id)
        return SessionInfo.from_proto(self._unary("CloseSession", req, timeout, session_id=session_id).session)

    def export_session(self, session_id: str, *, close: bool = False, timeout: float | None | object = DEFAULT,
                       progress: Callable[[int], None] | None = None) -> bytes:
        """The session's portable artifact: its KV cache, method state, pending token, conversation and owner
        (ExportSession's chunks joined). ``close=True`` closes it on the server once copied (the session moves).
        ``progress(bytes received so far)`` is called after each chunk. Not retried: with ``close`` a lost reply
        would lose the session."""
        req = pb.ExportSessionRequest(session_id=session_id, close=close)
        try:
            chunks = self._conn.rpc("ExportSession")(req, timeout=self.config.call_timeout(timeout),
                                              metadata=self.config.metadata(session_id))
            parts, done = [], 0
            for chunk in chunks:
                parts.append(chunk.data)
                done += len(chunk.data)
                if progress is not None:
                    progress(done)
            return b"".join(parts)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def import_session(self, artifact: bytes, *, session_id: str | None = None,
                       timeout: float | None | object = DEFAULT,
                       progress: Callable[[int, int], None] | None = None) -> SessionInfo:
        """Rebuild a session from ``export_session``'s artifact (same key, same model setup); it continues where
        the exported one stood. ``session_id``: its new id (default: the exported one's); through a router give
        it, so that the import carries the affinity key. ``progress(bytes sent so far, all bytes)`` is called as
        each chunk goes out. Not retried (a lost reply could import twice)."""
        metadata = self.config.metadata(session_id)
        requests = _requests.import_session_requests(artifact, session_id)

        def sent():
            done = 0
            for req in requests:
                yield req
                done += len(req.data)
                if progress is not None:
                    progress(done, len(artifact))

        try:
            return SessionInfo.from_proto(self._conn.rpc("ImportSession")(
                sent(), timeout=self.config.call_timeout(timeout), metadata=metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    # ---- tokenizer, model, server ---------------------------------------------------------

    def tokenize(self, text: str | None = None, *, messages=None,
                 timeout: float | None | object = DEFAULT) -> Tokenized:
        req = _requests.tokenize_request(text, messages)
        return Tokenized.from_proto(self._unary("Tokenize", req, timeout))

    def detokenize(self, token_ids, *, skip_special_tokens: bool = False,
                   timeout: float | None | object = DEFAULT) -> str:
        req = pb.DetokenizeRequest(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens)
        return self._unary("Detokenize", req, timeout).text

    def model_info(self, *, timeout: float | None | object = DEFAULT) -> ModelInfo:
        return ModelInfo.from_proto(self._unary("GetModelInfo", pb.GetModelInfoRequest(), timeout))

    def server_status(self, *, timeout: float | None | object = DEFAULT) -> ServerStatus:
        return ServerStatus.from_proto(self._unary("GetServerStatus", pb.GetServerStatusRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None | object = DEFAULT) -> str:
        """The standard health check: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"."""
        return status_name(self._unary(HEALTH, HealthCheckRequest(service=service), timeout))
