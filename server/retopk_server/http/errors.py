"""Errors of the HTTP front in OpenAI's JSON shape.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_argument"}}

``ApiError`` is what the routes answer: a gateway CallError (service/gateway.py) whose ``code`` is the gRPC
status the gRPC front would have answered and whose ``http_status`` comes from the same table (INVALID_ARGUMENT
-> 400, UNAUTHENTICATED -> 401, NOT_FOUND -> 404, RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503, ...), so the
two fronts fail alike. INTERNAL (500) is only ever a bug of ours.

A 503 carries ``Retry-After``: 1 second, the time for a router to send the retry to another replica, or 0 when the
session the call names has moved (a lingering drain's handoff, service/handoff_notices.py); then the header
``x-retopk-handoff`` names the session's new home, as gRPC's trailer of that name does, for the session's owner only.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.responses import JSONResponse

from retopk_server.service.gateway import HTTP_STATUS, CallError
from retopk_server.service.handoff_notices import NOTICE_METADATA

# gRPC status name -> OpenAI's error type
ERROR_TYPE: dict[str, str] = {
    "INVALID_ARGUMENT": "invalid_request_error",
    "OUT_OF_RANGE": "invalid_request_error",
    "UNAUTHENTICATED": "authentication_error",
    "PERMISSION_DENIED": "permission_error",
    "NOT_FOUND": "not_found_error",
    "ALREADY_EXISTS": "conflict_error",
    "FAILED_PRECONDITION": "conflict_error",
    "RESOURCE_EXHAUSTED": "rate_limit_error",
    "CANCELLED": "cancelled",
    "UNAVAILABLE": "service_unavailable",
    "DEADLINE_EXCEEDED": "timeout",
}
# gRPC status name -> (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {code: (HTTP_STATUS[code], kind) for code, kind in ERROR_TYPE.items()}


FIELD_CODES = ("INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION")
FIELD = re.compile(r"[A-Za-z_][\w.]*(\[[^\]]*\])*(\.[\w.]+)?")  # "max_new_tokens", "method.params['sink']"


class ApiError(CallError):
    """An HTTP error answer: ``code`` a gRPC status name, ``param`` the body's field at fault (or None);
    ``http_status`` overrides the code's HTTP status (413 for a body over the cap, which gRPC answers with
    RESOURCE_EXHAUSTED: the code stays the gRPC status, so that metrics count the one status both fronts know)."""

    def __init__(self, code: str, message: str, param: str | None = None, http_status: int | None = None,
                 trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(code, message, trailers)
        self.param, self._http_status = param, http_status

    @property
    def http_status(self) -> int:
        return self._http_status or super().http_status

    def body(self) -> dict:
        kind = ERROR_TYPE.get(self.code, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code.lower()}}

    def headers(self) -> dict[str, str]:
        headers = {"WWW-Authenticate": "Bearer"} if self.code == "UNAUTHENTICATED" else {}
        moved = [value for name, value in self.trailers if name == NOTICE_METADATA]
        if moved:
            headers[NOTICE_METADATA] = moved[0]
        if self.code == "UNAVAILABLE":
            headers["Retry-After"] = "0" if moved else "1"
        return headers

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.http_status, headers=self.headers())


def from_call_error(error: CallError, rename: Callable[[str], str] | None = None) -> ApiError:
    """The ApiError of a gateway CallError (an ApiError as it is); a message "<field>: <why>" (INVALID_ARGUMENT, or
    NOT_FOUND / ALREADY_EXISTS / FAILED_PRECONDITION about a session) has its field renamed from the
    GenerateRequest's name to the body's (``rename``) and reported as ``param``."""
    if isinstance(error, ApiError):
        return error
    code, message = error.code, error.message
    head, sep, rest = message.partition(": ")
    if code in FIELD_CODES and sep and FIELD.fullmatch(head):
        param = rename(head) if rename else head
        return ApiError(code, f"{param}: {rest}", param, trailers=error.trailers)
    return ApiError(code, message, trailers=error.trailers)
