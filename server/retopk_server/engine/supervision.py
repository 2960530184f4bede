"""Supervision: the engine loop wrapped, so that a loop that dies or hangs fails the engine cleanly.

``run(loop)`` runs the loop until it returns (a stop) or raises: the exception becomes the engine's
``failure`` (health NOT_SERVING, ``serve`` exits 70). Either way submission and commands close, and
what is left fails (``EngineLoop.shutdown``). What a failure ends is sorted in faults.py.

Watchdog: the loop stamps ``beat`` at the start of every pass (engine thread). ``check_hung`` (the
service's Supervisor calls it at every poll, from the asyncio thread) finds the engine hung when work is
pending (requests running, queued or being admitted, or commands queued) and the stamp is older than
``config.watchdog_timeout_s``: the thread is stuck in a runner call, a kernel or a lock. A thread cannot
be stopped from outside, so the engine is declared failed in its place: ``failure`` becomes EngineHung,
submission and commands are closed, every request it holds ends UNAVAILABLE at once, without touching the
runner or the sessions (the hung thread owns them), and the thread's stack is logged, to show where it
hangs. Should the thread ever come back, its loop sees the stop and ends.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from retopk_server.engine.commands import CommandQueue
from retopk_server.engine.faults import EngineHung, cause, engine_failed_error
from retopk_server.engine.loop import EngineLoop
from retopk_server.engine.requests import EngineConfig, EngineError, ErrorCode
from retopk_server.engine.scheduler import Scheduler

log = logging.getLogger("retopk_server.engine")


class Supervision:
    """The loop's failure and the watchdog (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, commands: CommandQueue, config: EngineConfig,
                 hook: Callable[..., None]) -> None:
        self.scheduler, self.commands, self.config, self.hook = scheduler, commands, config, hook
        self.failure: BaseException | None = None  # why the loop died (faults.py), None while it runs
        self.loop: EngineLoop | None = None
        self.thread: threading.Thread | None = None  # the engine thread, whose stack a hang logs

    @property
    def last_beat(self) -> float | None:
        """When the loop last started a pass (None before it runs)."""
        return self.loop.beat if self.loop is not None else None

    def close(self) -> None:
        """Under the scheduler's lock: from now on submit and the commands answer UNAVAILABLE."""
        self.scheduler.stop()
        self.commands.closed = True

    def run(self, loop: EngineLoop) -> None:
        """Run ``loop`` until it returns (a stop) or raises (``failure``), then fail what is left."""
        error = EngineError(ErrorCode.UNAVAILABLE, "server shut down before the request finished")
        loop.beat = time.monotonic()
        self.loop = loop
        try:
            loop.run()
        except BaseException as e:  # noqa: BLE001 - the loop died: fail what is left, tell the supervisor
            self.failure = e
            log.critical("engine loop failed, the engine stops: %s", cause(e), exc_info=e)
            error = engine_failed_error(e)
        finally:
            with self.scheduler.lock:
                self.close()
            loop.shutdown(error)

    def check_hung(self) -> bool:
        """Any thread: True when the loop is found hung now, the engine then failed (module docstring)."""
        timeout = self.config.watchdog_timeout_s
        if timeout is None or self.last_beat is None or self.failure is not None or self.scheduler.stopped:
            return False
        with self.scheduler.lock:  # the loop holds it for moments only, never across a runner call
            stalled = time.monotonic() - self.last_beat
            if stalled <= timeout or not (self.scheduler.busy() or self.commands):
                return False
            self.failure = EngineHung(f"the engine loop made no progress for {stalled:.1f} s with work pending "
                                      f"(--watchdog-timeout-s {timeout:g})")
            self.close()
            held = self.scheduler.held()
        frame = sys._current_frames().get(self.thread.ident)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)\n"
        log.critical("%s: the engine stops; its thread is at\n%s", self.failure, stack.rstrip())
        error = engine_failed_error(self.failure)
        for r in held:
            if not r.stream.closed:
                r.stream.fail(error)
                self.hook("on_error", r, error.code.value)
        self.commands.fail_pending()
        return True
