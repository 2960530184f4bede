"""Errors of the HTTP front in OpenAI's JSON shape, and the HTTP status of each gRPC status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_argument"}}

``ApiError`` is what the routes answer; ``code`` is the gRPC status name the gRPC front would have
answered (INVALID_ARGUMENT -> 400, UNAUTHENTICATED -> 401, NOT_FOUND -> 404, RESOURCE_EXHAUSTED -> 429,
UNAVAILABLE -> 503, ...), so the two fronts fail alike. INTERNAL (500) is only ever a bug of ours.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi.responses import JSONResponse

# gRPC status name -> (HTTP status, OpenAI error type)
STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "FAILED_PRECONDITION": (409, "conflict_error"),  # e.g. the session is busy with another request
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "cancelled"),  # the client went away; nobody reads it
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


FIELD_CODES = ("INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS", "FAILED_PRECONDITION")
FIELD = re.compile(r"[A-Za-z_][\w.]*(\[[^\]]*\])*(\.[\w.]+)?")  # "max_new_tokens", "method.params['sink']"


class ApiError(Exception):
    """An HTTP error answer: ``code`` a gRPC status name, ``param`` the body's field at fault (or None);
    ``http_status`` overrides the code's HTTP status (413 for a body over the cap, which gRPC answers with
    RESOURCE_EXHAUSTED: the code stays the gRPC status, so that metrics count the one status both fronts know)."""

    def __init__(self, code: str, message: str, param: str | None = None, http_status: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.http_status = code, message, param, http_status

    @property
    def status(self) -> int:
        return self.http_status or STATUS.get(self.code, (500, "server_error"))[0]

    def body(self) -> dict:
        kind = STATUS.get(self.code, (500, "server_error"))[1]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code.lower()}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.code == "UNAUTHENTICATED" else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_status(code: str, message: str, rename: Callable[[str], str] = lambda field: field) -> ApiError:
    """The ApiError of a gRPC status; a message "<field>: <why>" (INVALID_ARGUMENT, or NOT_FOUND / ALREADY_EXISTS /
    FAILED_PRECONDITION about a session) has its field renamed from the GenerateRequest's name to the body's
    (``rename``) and reported as ``param``."""
    head, sep, rest = message.partition(": ")
    if code in FIELD_CODES and sep and FIELD.fullmatch(head):
        param = rename(head)
        return ApiError(code, f"{param}: {rest}", param)
    return ApiError(code, message)
