"""CommandQueue: work handed to the engine thread from other threads, answered through futures.

Session commands, tokenization and status touch the runner, which only the engine thread may use;
the loop runs the queued commands between decode steps.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable

from retopk_server.engine.requests import EngineError, ErrorCode


class CommandQueue:
    """``call`` (any thread) queues ``fn``; ``run_pending`` (engine thread) runs what is queued.

    ``lock`` is the engine's lock (a Condition's): the loop checks for commands under it before it sleeps.
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._queue: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self._queue)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                future.set_exception(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down"))
                return future
            self._queue.append((fn, future))
            self._lock.notify_all()
        return future

    def run_pending(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                fn, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def fail_pending(self) -> None:
        """Answer every queued command with UNAVAILABLE (shutdown)."""
        with self._lock:
            pending, self._queue = list(self._queue), deque()
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down"))
