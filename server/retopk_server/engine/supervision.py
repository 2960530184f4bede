"""The engine's handling of its own failures: a failed step, a broken runner, a hung loop, the shutdown.

A mixin of Engine (scheduler.py), on its state: the lock ``_wake``, the queue, the batch, the request
being admitted, the command queue, the runner, ``failure``. What a failure ends is sorted in faults.py.

The loop runs under ``_supervise``: when it raises, that is the engine's ``failure``. A failed batched
decode step is retried one request at a time (``_decode_alone``), so that only the requests that fail
alone end; after a runner call failed, ``_check_runner`` probes the runner and a broken one ends the
loop (EngineFailed). ``_shutdown`` fails what is left when the loop ends.

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
from collections import deque

from retopk_server.engine.faults import (
    EngineFailed,
    EngineHung,
    cause,
    engine_failed_error,
    request_error,
    runner_broken,
)
from retopk_server.engine.requests import EngineError, ErrorCode
from retopk_server.engine.turn import ActiveRequest

log = logging.getLogger("retopk_server.engine")


class Supervision:
    """Engine's failure handling and watchdog (see the module docstring)."""

    _beat: float | None = None  # when the loop last started a pass (None before it runs)

    def _supervise(self, loop) -> None:
        """Run ``loop`` until it returns (a stop) or raises (``failure``), then fail what is left (``_shutdown``)."""
        error = EngineError(ErrorCode.UNAVAILABLE, "server shut down before the request finished")
        self._beat = time.monotonic()
        try:
            loop()
        except BaseException as e:  # noqa: BLE001 - the loop died: fail what is left, tell the supervisor
            self.failure = e
            log.critical("engine loop failed, the engine stops: %s", cause(e), exc_info=e)
            error = engine_failed_error(e)
        finally:
            with self._wake:  # from now on submit and the commands answer UNAVAILABLE
                self._stop = self._commands.closed = True
            self._shutdown(error)

    def _decode_alone(self, batch: list[ActiveRequest], want_stats: bool, error: Exception) -> None:
        """After a failed batched step: decode each request alone, so only those that fail alone end.

        A row whose step fails gets its status (faults.request_error); when every row failed, the runner
        is probed and a broken one ends the engine (EngineFailed). Layers the failed step reached may
        have seen the token once already; their keys and values are overwritten by the retry.
        """
        failed = 0
        for r in batch if len(batch) > 1 else ():
            t0 = time.monotonic()
            try:
                logits, stats = self.runner.decode([r.record.session], [r.last_token], with_stats=want_stats)
            except Exception as e:
                log.exception("decode of request %s alone failed", r.spec.request_id)
                self._fail(r, request_error("decode", e))
                failed += 1
                continue
            self._hook("on_step", [r], time.monotonic() - t0, stats)
            self._step_row(r, logits[0], stats[0] if stats is not None else None)
        if len(batch) == 1:
            self._fail(batch[0], request_error("decode", error))
        self._running = [r for r in batch if not r.done]
        if failed == len(batch) or len(batch) == 1:
            self._check_runner(error)

    def _check_runner(self, error: Exception) -> None:
        """EngineFailed when the runner is broken after it raised ``error`` (engine/faults.py)."""
        if (why := runner_broken(self.runner, error)) is not None:
            raise EngineFailed(f"the runner is broken: {cause(error)}; probe: {cause(why)}") from why

    def _shutdown(self, error: EngineError) -> None:
        """Fail what is left with ``error``, close every session, answer pending commands."""
        if self._admitting is not None:
            self._end_admission(self._admitting, error)
        for r in list(self._running):
            self._fail(r, error)
        self._running = []
        with self._wake:
            queued, self._queue = list(self._queue), deque()
        for r in queued:
            self._fail(r, error)
        self._commands.fail_pending()
        self.sessions.close_all()

    # ---- the watchdog ------------------------------------------------------------------------------------
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
