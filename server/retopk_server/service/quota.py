"""StreamQuota: concurrent Generate streams per caller (``Caller.max_streams``), shared by every front.

A front calls ``acquire(caller)`` before it submits a request and ``release(caller)`` once the stream
ended (``with quota.stream(caller):`` does both). The per-key limit on open sessions lives with the
sessions (engine/session_table.py), since only the engine knows when one closes.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

from retopk_server.service.auth import Caller


class TooManyStreams(Exception):
    """The caller already has ``max_streams`` streams open (RESOURCE_EXHAUSTED)."""


class StreamQuota:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def open(self, caller: Caller) -> int:
        """Streams ``caller`` has open now."""
        return self._open[caller.name]

    def acquire(self, caller: Caller) -> None:
        """Count one more stream of ``caller``; TooManyStreams when at its limit (nothing counted)."""
        with self._lock:
            if caller.max_streams is not None and self._open[caller.name] >= caller.max_streams:
                raise TooManyStreams(f"too many concurrent streams for key {caller.label!r} "
                                     f"(max_streams {caller.max_streams} per key); wait for one to finish")
            self._open[caller.name] += 1

    def release(self, caller: Caller) -> None:
        with self._lock:
            self._open[caller.name] -= 1
            if self._open[caller.name] <= 0:
                del self._open[caller.name]

    @contextmanager
    def stream(self, caller: Caller):
        self.acquire(caller)
        try:
            yield
        finally:
            self.release(caller)
