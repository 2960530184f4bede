"""RequestStream: carries one request's events from the engine thread to the asyncio task reading them."""

from __future__ import annotations

import asyncio

from retopk_server.engine.requests import EngineError, TokenEvent

_END = object()


class RequestStream:
    """Engine thread: ``put`` / ``fail``; asyncio side: ``async for event in stream`` and ``cancel``.

    Iteration yields TokenEvents and raises the EngineError that ended the request, if any. A
    cancelled stream is dropped by the engine at its next step (its slot and ephemeral session freed).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set by the consumer, read by the engine thread (a plain bool is atomic)
        self.closed = False  # set by the engine once it sent the last event

    # --- engine thread -------------------------------------------------------------------------
    def _send(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    def put(self, event: TokenEvent) -> None:
        self._send(event)
        if event.finish_reason is not None:
            self.closed = True
            self._send(_END)

    def fail(self, error: EngineError) -> None:
        self.closed = True
        self._send(error)

    # --- asyncio side --------------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled = True

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, EngineError):
            raise item
        return item

