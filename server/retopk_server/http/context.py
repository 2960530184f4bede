"""HttpContext: an HTTP request seen as the grpc.aio.ServicerContext the gRPC servicer's methods take.

The HTTP front calls the servicer's own ``Generate`` / ``GetModelInfo`` with it, so an HTTP request goes
through the same key check, affinity check, validation, limits and metrics as a gRPC call. The metadata
is what the HTTP request carries of it: ``authorization`` (the same "Bearer <key>") and ``x-session-id``
(the routers' affinity key). ``abort`` raises ``Aborted``, which the routes turn into an OpenAI error.
HTTP has no deadline: ``time_remaining`` is None (a client that goes away cancels the request instead).
"""

from __future__ import annotations

import grpc

from retopk_shared.metadata import AUTHORIZATION, SESSION_METADATA

METADATA_HEADERS = (AUTHORIZATION, SESSION_METADATA)


class Aborted(Exception):
    """The servicer ended the call with ``code`` (a grpc.StatusCode name) and ``message``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class HttpContext:
    def __init__(self, headers, client: tuple[str, int] | None) -> None:
        self._metadata = tuple((name, value) for name, value in headers.items() if name in METADATA_HEADERS)
        self._peer = f"ipv4:{client[0]}:{client[1]}" if client else "unknown"

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        return None

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict:
        return {}  # no TLS client certificate over this front

    def set_code(self, code) -> None:
        pass

    def set_details(self, details) -> None:
        pass

    def set_trailing_metadata(self, metadata) -> None:
        pass

    async def send_initial_metadata(self, metadata) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise Aborted(code.name, details)
