"""The engine's watch over itself: a loop that stops making progress is a failed engine.

A mixin of Engine (scheduler.py), on its state: the lock ``_wake``, the queue, the batch, the request
being admitted, the command queue, ``failure``.

Watchdog: the loop stamps ``_beat`` at the start of every pass (engine thread). ``check_hung`` (the
service's Supervisor calls it at every poll, from the asyncio thread) finds the engine hung when work is
pending (requests running, queued or being admitted, or commands queued) and the stamp is older than
``config.watchdog_timeout_s``: the thread is stuck in a runner call, a kernel or a lock. A thread cannot
be stopped from outside, so the engine is declared failed in its place: ``failure`` becomes EngineHung
(health NOT_SERVING, ``serve`` exits 70), submission and commands are closed, every request it holds
ends UNAVAILABLE at once, without touching the runner or the sessions (the hung thread owns them), and
the thread's stack is logged, to show where it hangs. Should the thread ever come back, its loop sees
the stop and ends.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback

from retopk_server.engine.faults import EngineHung, engine_failed_error

log = logging.getLogger("retopk_server.engine")


class Supervision:
    """Engine's watchdog (see the module docstring)."""

    _beat: float | None = None  # when the loop last started a pass (None before it runs)

    def _pending(self) -> bool:
        """Work waits on the loop (call under ``_wake``)."""
        return bool(self._running or self._queue or self._admitting is not None or self._commands)

    def check_hung(self) -> bool:
        """Any thread: True when the loop is found hung now, the engine then failed (module docstring)."""
        timeout = self.config.watchdog_timeout_s
        if timeout is None or self._beat is None or self.failure is not None or self._stop:
            return False
        with self._wake:  # the loop holds it for moments only, never across a runner call
            stalled = time.monotonic() - self._beat
            if stalled <= timeout or not self._pending():
                return False
            self.failure = EngineHung(f"the engine loop made no progress for {stalled:.1f} s with work pending "
                                      f"(--watchdog-timeout-s {timeout:g})")
            self._stop = self._commands.closed = True
            held = [*self._queue, *self._running, *([self._admitting] if self._admitting is not None else [])]
        frame = sys._current_frames().get(self._thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        log.critical("%s: the engine stops; its thread is at\n%s", self.failure, stack.rstrip())
        error = engine_failed_error(self.failure)
        for r in held:
            if not r.stream.closed:
                r.stream.fail(error)
                self._hook("on_error", r, error.code.value)
        self._commands.fail_pending()
        return True
