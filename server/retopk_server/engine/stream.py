"""RequestStream: carries one request's events from the engine thread to the asyncio task reading them; and
``gathered_sends``, under which the engine thread's sends of one decode step reach each event loop in one call."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from retopk_server.engine.requests import EngineError, TokenEvent

_END = object()
log = logging.getLogger("retopk_server.engine")
# While a thread is inside ``gathered_sends``: its ``sends``, per event loop the (queue, item) pairs in send order.
_gathering = threading.local()


@contextmanager
def gathered_sends() -> Iterator[None]:
    """Inside, this thread's stream sends (``put``, ``fail``) are kept in order and handed, when it ends, to each
    event loop in one ``call_soon_threadsafe``: a decode step's B tokens wake the asyncio thread once, not once a
    row. Each stream's items keep their order and the flags (``closed``) change at once, as without it; the items
    only arrive together, after the step's last row. Nested, the outermost one sends."""
    if getattr(_gathering, "sends", None) is not None:
        yield
        return
    sends: dict[asyncio.AbstractEventLoop, list] = {}
    _gathering.sends = sends
    try:
        yield
    finally:
        _gathering.sends = None
        for loop, items in sends.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
                pass


def _put_all(items: list) -> None:
    """On the event loop: each (queue, item) in order (the queues are unbounded: put_nowait cannot refuse)."""
    for queue, item in items:
        queue.put_nowait(item)


class RequestStream:
    """Engine thread: ``put`` / ``fail``; asyncio side: ``async for event in stream`` and ``cancel``.

    Iteration yields TokenEvents and raises the EngineError that ended the request, if any. A
    cancelled stream is dropped by the engine at its next step (its slot and ephemeral session freed);
    one still queued is withdrawn at once through ``on_cancel`` (set by the engine at submission).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False  # set by the consumer, read by the engine thread (a plain bool is atomic)
        self.closed = False  # set by the engine once it sent the last event
        self.choices = 1  # the request's n: the stream ends with the n-th event that has a finish_reason
        self.on_cancel: Callable[[], None] | None = None
        self.cut_error: EngineError | None = None  # set with ``cut``, before ``cancelled``

    # --- engine thread -------------------------------------------------------------------------
    def _send(self, item) -> None:
        sends = getattr(_gathering, "sends", None)
        if sends is not None:  # inside gathered_sends: sent with the step's others when it ends
            sends.setdefault(self._loop, []).append((self._queue, item))
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            pass

    def put(self, event: TokenEvent) -> None:
        self._send(event)
        if event.finish_reason is not None:
            self.choices -= 1
            if self.choices <= 0:
                self.closed = True
                self._send(_END)

    def fail(self, error: EngineError) -> None:
        self.closed = True
        self._send(error)

    # --- asyncio side --------------------------------------------------------------------------
    def cancel(self) -> None:
        self.cancelled = True
        callback, self.on_cancel = self.on_cancel, None
        if callback is not None and not self.closed:
            try:
                callback()
            except Exception:  # the engine drops the request at its next step anyway
                log.exception("withdrawing a cancelled request failed")

    def cut(self, error: EngineError) -> None:
        """End the request with ``error`` (a drain whose grace is over while the server still listens): the engine
        drops it at its next step as a cancelled one, but fails it with ``error``, after every token it streamed,
        so that the session holds exactly what the reader was sent."""
        self.cut_error = error
        self.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, EngineError):
            raise item
        return item

