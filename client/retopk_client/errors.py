"""Typed exceptions: every failed call raises a subclass of ``RetopkError`` chosen by its gRPC status code.

Callers catch the class they can act on (``InvalidArgument`` names the bad field in its message,
``ResourceExhausted`` means retry later, ``NotFound`` usually means an unknown session) and read
``code`` (the ``grpc.StatusCode``) and ``message`` (the server's details) from any of them.
"""

from __future__ import annotations

import grpc

# Trailer of a draining server's answer on a session it handed over: the address where the session continues.
HANDOFF_METADATA = "x-retopk-handoff"


class RetopkError(Exception):
    """A failed call: ``code`` is the gRPC status code, ``message`` the server's explanation; ``handoff`` the
    address a draining server's notice names as the session's new home (HANDOFF_METADATA), else None."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    handoff: str | None = None

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class InvalidArgument(RetopkError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RetopkError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(RetopkError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(RetopkError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(RetopkError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(RetopkError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(RetopkError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(RetopkError):
    code = grpc.StatusCode.CANCELLED


class Unavailable(RetopkError):
    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(RetopkError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(RetopkError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(RetopkError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Aborted(RetopkError):
    code = grpc.StatusCode.ABORTED


class InternalError(RetopkError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[RetopkError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, OutOfRange, ResourceExhausted,
        DeadlineExceeded, Cancelled, Unavailable, Unauthenticated, PermissionDenied, Unimplemented,
        Aborted, InternalError,
    )
}


def error_for(code: grpc.StatusCode, message: str) -> RetopkError:
    """The typed exception for a status code (``RetopkError`` itself for codes without a subclass)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else RetopkError(message, code)


def from_rpc_error(err: grpc.RpcError) -> RetopkError:
    """Translate a ``grpc.RpcError`` (sync or asyncio) into the matching ``RetopkError``."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    error = error_for(code or grpc.StatusCode.UNKNOWN, details or "")
    trailers = err.trailing_metadata() if callable(getattr(err, "trailing_metadata", None)) else None
    notices = [v for k, v in (trailers or ()) if k == HANDOFF_METADATA]
    if len(notices) == 1 and isinstance(notices[0], str) and notices[0]:
        error.handoff = notices[0]
    return error
