"""service/gateway.py's CallError: one error type, whose code is the gRPC status and gives the HTTP status, for
whatever a call raised (the fronts' status tables, docs/http.md's included, are held to it elsewhere)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from retopk_server.engine.requests import EngineError, ErrorCode
from retopk_server.service.auth import Unauthenticated
from retopk_server.service.gateway import HTTP_STATUS, Call, CallError
from retopk_server.service.quota import TooManyStreams
from retopk_server.service.wire import InvalidArgument


@pytest.mark.parametrize("raised, code, http", [
    (InvalidArgument("max_new_tokens", "must lie in [1, 8], got 0"), "INVALID_ARGUMENT", 400),
    (Unauthenticated(), "UNAUTHENTICATED", 401),
    (TooManyStreams("alice has 4 streams open"), "RESOURCE_EXHAUSTED", 429),
    (EngineError(ErrorCode.NOT_FOUND, "session_id: no session 'a'"), "NOT_FOUND", 404),
    (EngineError(ErrorCode.FAILED_PRECONDITION, "session_id: busy"), "FAILED_PRECONDITION", 409),
    (EngineError(ErrorCode.UNAVAILABLE, "draining"), "UNAVAILABLE", 503),
    (CallError("UNAVAILABLE", "moved", (("x-retopk-handoff", "b:1"),)), "UNAVAILABLE", 503),
])
def test_every_refusal_is_one_call_error_with_both_statuses(raised, code, http):
    error = CallError.of(raised)
    assert (error.code, error.grpc_status, error.http_status) == (code, grpc.StatusCode[code], http)
    assert error.message == (raised.message if isinstance(raised, (EngineError, CallError)) else str(raised))


def test_a_bug_is_internal_and_logged_without_its_text(caplog):
    error = CallError.of(KeyError("secret detail"))
    assert (error.code, error.grpc_status, error.http_status) == ("INTERNAL", grpc.StatusCode.INTERNAL, 500)
    assert "secret detail" not in error.message and "KeyError" in error.message
    assert "internal error" in caplog.text


def test_the_http_table_knows_only_grpc_status_names():
    assert set(HTTP_STATUS) <= {s.name for s in grpc.StatusCode}
    assert CallError("ALREADY_EXISTS", "x").trailers == ()


@pytest.mark.parametrize("raised, answer, code", [
    (InvalidArgument("n", "must lie in [1, 16], got 17"), "INVALID_ARGUMENT", "INVALID_ARGUMENT"),
    (asyncio.CancelledError(), None, "DEADLINE_EXCEEDED"),
])
def test_a_stopped_call_is_reported_once_whichever_front_ends_it(raised, answer, code):
    """Call.stopped, the one ending of a call that raised: a refusal reports on_error and gives its CallError, a
    cancellation gives None (the front raises it on) with the code its client saw; on_rpc once either way."""
    seen = []
    call = Call(lambda name, *args: seen.append((name, *args[:2])), "Generate")
    error = call.stopped(raised, cancelled="DEADLINE_EXCEEDED")
    call.end()
    assert (error.code if error else None) == answer and call.code == code
    errors = [("on_error", None, code)] if answer else []
    assert seen == errors + [("on_rpc", "Generate", code)]
