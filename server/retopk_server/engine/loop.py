"""EngineLoop: the engine thread's loop, which runs what the scheduler plans.

One pass: run queued commands (sessions, tokenize, status: commands.py), so a command waits for at most one
iteration, never for a whole long prompt; close sessions idle past their timeout; while there is nothing to
do, let the runner give back what its pools kept for a load that has not come back (``trim_pools``) and
sleep; else one ``step``:

  1. plan (scheduler.py): end the cancelled and the expired requests, budget the prompt tokens
  2. prefill (admission.py): prompt chunks within the budget, admitting queued requests while the batch has
     room, all of them fed in one forward (a first prompt whose start a prefill under way will cache waits
     for it); a prompt that is in joins the batch
  3. reserve each running request's next KV block (evicting idle sessions under memory pressure)
  4. decode: one batched ``runner.decode`` over every running request (sessions may differ in length and
     method), then each row samples and streams its token (delivery.py)

A failed batched step is retried one request at a time, so that only the requests that fail alone end;
when every row failed the runner is probed, and a broken runner ends the loop (faults.check_runner). The
loop stamps ``beat`` at every pass: the watchdog's sign of progress (supervision.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from retopk_server.engine.admission import Admission
from retopk_server.engine.commands import CommandQueue
from retopk_server.engine.delivery import Delivery
from retopk_server.engine.faults import check_runner, request_error
from retopk_server.engine.observer import EngineObserver
from retopk_server.engine.requests import EngineConfig, EngineError
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.scheduler import Scheduler
from retopk_server.engine.session_table import SessionTable
from retopk_server.engine.stream import gathered_sends
from retopk_server.engine.turn import ActiveRequest
from retopk_server.runtime.sampling import greedy_tokens

log = logging.getLogger("retopk_server.engine")


class EngineLoop:
    """The loop and its step (see the module docstring); built on the engine thread once the runner is."""

    def __init__(self, runner: Runner, scheduler: Scheduler, sessions: SessionTable, commands: CommandQueue,
                 delivery: Delivery, config: EngineConfig, observer: EngineObserver, hook: Callable[..., None]) -> None:
        self.runner, self.scheduler, self.sessions, self.commands = runner, scheduler, sessions, commands
        self.delivery, self.config, self.observer, self.hook = delivery, config, observer, hook
        self.admission = Admission(runner, scheduler, sessions, self.delivery, config, hook)
        self.beat = time.monotonic()  # when the loop last started a pass

    def run(self) -> None:
        """Pass after pass until the scheduler is stopped."""
        scheduler = self.scheduler
        while True:
            self.beat = time.monotonic()
            self.commands.run_pending()
            self.sessions.expire_idle()
            with scheduler.lock:
                if scheduler.stopped:
                    return
                idle = not scheduler.busy() and not self.commands
            if idle:
                self.runner.trim_pools()  # what the pools kept for a load that has not come back
                with scheduler.lock:
                    if not scheduler.stopped and not scheduler.busy() and not self.commands:
                        scheduler.lock.wait(self.config.idle_wait_s)
                continue
            self.step()
            self.hook("on_load", *scheduler.load(), len(self.sessions))

    def step(self) -> None:
        """One iteration: the plan's ends, prompt chunks within its budget, one decode step of the batch."""
        plan = self.scheduler.plan(time.monotonic())
        for r, error in plan.dropped:
            self.delivery.fail(r, error)
        budget, chunks = plan.prefill_tokens, []
        while budget > 0 and (r := self.scheduler.next_prefill([c for c, _ in chunks])) is not None:
            n = self.admission.admit(r, budget)
            if n is None:  # its prompt waits for one under way (admission.py); nothing overtakes it
                break
            if n:
                chunks.append((r, n))
                budget -= n
        if chunks:
            self.admission.feed(chunks)
        if self.scheduler.running:
            self.reserve()
        if self.scheduler.running:
            self.decode(list(self.scheduler.running))

    def reserve(self) -> None:
        """KV room for every running request's next token, evicting idle sessions under memory pressure; a
        request whose next block does not fit even then ends RESOURCE_EXHAUSTED (the others go on)."""
        batch = self.scheduler.running
        for r in batch:
            session = r.record.session
            try:
                self.sessions.with_room("decoding the next token", self.runner.reserve, session, session.length + 1)
            except EngineError as e:
                self.delivery.fail(r, e)
            except ValueError:  # past max_context: the decode step reports it
                pass
            except Exception as e:  # an allocation failure or a bug: this request alone ends (faults.py)
                log.exception("reserving the next KV block of request %s failed", r.spec.request_id)
                self.delivery.fail(r, request_error("reserving the next KV block", e))
        self.scheduler.keep_going(batch)

    def decode(self, batch: list[ActiveRequest]) -> None:
        """One batched decode step of ``batch``, then each row's token; a failed step goes row by row."""
        want_stats = self.observer.wants_step_stats or any(r.spec.return_step_stats for r in batch)
        for r in batch:  # constrained rows: their next masks are computed while the model runs
            if r.constraint is not None:
                r.constraint.start_fill()
        t0 = time.monotonic()
        try:
            logits, stats = self.runner.decode([r.record.session for r in batch], [r.last_token for r in batch],
                                               with_stats=want_stats)  # (B, vocab)
        except Exception as e:
            log.exception("batched decode of %d requests failed", len(batch))
            self._decode_alone(batch, want_stats, e)
            return
        self.hook("on_step", batch, time.monotonic() - t0, stats)
        try:
            greedy = greedy_tokens([r.sampler for r in batch], logits)  # the plain greedy rows in one argmax
        except Exception:  # then each row samples on its own, and a failure there ends that row alone
            log.exception("the batched argmax of %d rows failed", len(batch))
            greedy = {}
        # The rows' tokens reach the asyncio thread in one call, after the last row; the sessions of the requests
        # that end close together before that (their pools' upkeep once).
        with gathered_sends(), self.sessions.closing():
            for i, r in enumerate(batch):
                self.delivery.step_row(r, logits[i], stats[i] if stats is not None and r.spec.return_step_stats
                                       else None, greedy.get(i))
        self.scheduler.keep_going(batch)

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
                self.delivery.fail(r, request_error("decode", e))
                failed += 1
                continue
            self.hook("on_step", [r], time.monotonic() - t0, stats)
            self.delivery.step_row(r, logits[0], stats[0] if stats is not None else None)
        if len(batch) == 1:
            self.delivery.fail(batch[0], request_error("decode", error))
        self.scheduler.keep_going(batch)
        if failed == len(batch) or len(batch) == 1:
            check_runner(self.runner, error)

    def shutdown(self, error: EngineError) -> None:
        """Fail what is left with ``error``, close every session, answer pending commands."""
        scheduler = self.scheduler
        for r in list(scheduler.admitting):
            self.admission.end(r, error)
        for r in list(scheduler.running):
            self.delivery.fail(r, error)
        scheduler.running = []
        for r in scheduler.take_queue():
            self.delivery.fail(r, error)
        self.commands.fail_pending()
        self.sessions.close_all()
