"""Scheduler: the admission queue, the request being admitted and the running batch, and each iteration's plan.

It decides and keeps the books; it never touches the runner, so it runs without a model (the loop,
loop.py, does what it decides). Per iteration of the loop:

  ``plan(now)``      takes out the requests whose client cancelled or whose deadline passed (running and
                     queued) and sets the iteration's prompt-token budget: ``max_step_tokens`` less one
                     decode token per running request, at least one (StepPlan)
  ``next_prefill(fed)`` who gets the iteration's next prompt chunk (``fed``: those given one already): a request
                     being admitted, else the head of the queue while the batch has room beside the running and
                     admitted requests (``max_running``; a request with n choices needs room for n, unless the
                     batch is empty). First come, first served: nothing overtakes the head. The loop feeds the
                     chunks it hands out in one forward; a prompt that does not fit the iteration's budget stays
                     admitted, and so does one that waits for a prefill under way to cache its start
                     (admission.py); those two at most are between the queue and the batch from one iteration
                     to the next.
  ``joined(r, rows)`` a prompt is in: its rows join the batch, ``r`` leaves admission

Threading: the asyncio thread queues (``enqueue``, under ``lock``) and withdraws a cancelled queued request;
everything else runs on the engine thread, which alone changes the batch and the request being admitted.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from retopk_server.engine.requests import EngineConfig, EngineError, ErrorCode
from retopk_server.engine.turn import ActiveRequest


@dataclass
class StepPlan:
    """What one iteration does first: end ``dropped`` (already out of the queue and the batch, each with the
    status that ends it), then feed at most ``prefill_tokens`` prompt tokens, then decode the batch."""

    dropped: list[tuple[ActiveRequest, EngineError]]
    prefill_tokens: int


class Scheduler:
    """The queue, the request being admitted and the batch, with the engine's one lock (see the module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.lock = threading.Condition(threading.Lock())  # the command queue waits on it too (commands.py)
        self.queue: deque[ActiveRequest] = deque()
        self.running: list[ActiveRequest] = []
        self.admitting: list[ActiveRequest] = []  # between the queue and the batch (prefilling)
        self.draining = False  # new requests are refused; queued and running ones go on
        self.stopped = False  # the loop ends at its next pass; nothing new is accepted

    # ---- any thread --------------------------------------------------------------------------------------
    def check_open(self) -> None:
        """Under ``lock``: UNAVAILABLE while draining or stopped, RESOURCE_EXHAUSTED with the queue full."""
        if self.draining or self.stopped:
            raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not accepting new requests")
        if len(self.queue) >= self.config.max_queue:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"admission queue is full ({self.config.max_queue} requests waiting); retry later")

    def enqueue(self, r: ActiveRequest) -> None:
        """Under ``lock``, after ``check_open``: ``r`` waits at the end of the queue; the loop wakes."""
        self.queue.append(r)
        self.lock.notify_all()

    def withdraw(self, r: ActiveRequest) -> bool:
        """Take ``r`` out of the queue -> whether it was still there (not yet admitted)."""
        with self.lock:
            try:
                self.queue.remove(r)
            except ValueError:
                return False
        return True

    def stop(self) -> None:
        """Under ``lock``: the loop ends at its next pass, nothing new is accepted."""
        self.stopped = True
        self.lock.notify_all()

    def busy(self) -> bool:
        """Under ``lock``: requests are queued, being admitted or running."""
        return bool(self.running or self.queue or self.admitting)

    def held(self) -> list[ActiveRequest]:
        """Under ``lock``: every request queued, running or being admitted."""
        return [*self.queue, *self.running, *self.admitting]

    def in_flight(self) -> int:
        """Requests queued or running. A request counts as finished once its last event is out, even if the
        engine thread has not yet dropped it from the batch."""
        with self.lock:
            live = {id(r) for r in [*self.running, *self.admitting] if not r.done}
            return len(self.queue) + len(live)

    def load(self) -> tuple[int, int]:
        """(queued, running) requests, those being admitted counted as running."""
        with self.lock:
            return len(self.queue), len(self.running) + len(self.admitting)

    # ---- engine thread -----------------------------------------------------------------------------------
    def plan(self, now: float) -> StepPlan:
        """Take out the running and queued requests that were cancelled or ran past their deadline, and budget
        the iteration's prompt tokens (module docstring). The request being admitted is checked when it gets
        its chunk (the loop), so that a request admitted in this iteration is checked too."""
        dropped = [(r, error) for r in self.running if (error := r.dropped(now)) is not None]
        ended = {id(r) for r, _ in dropped}
        self.running = [r for r in self.running if id(r) not in ended and not r.done]
        with self.lock:  # their queue slot and session are free now, not when they would have been admitted
            late = [r for r in self.queue if r.dropped(now) is not None]
            for r in late:
                self.queue.remove(r)
        dropped += [(r, r.dropped(now, " while queued")) for r in late]
        return StepPlan(dropped, max(1, self.config.max_step_tokens - len(self.running)))

    def next_prefill(self, fed: list[ActiveRequest] = ()) -> ActiveRequest | None:
        """The request to feed the iteration's next prompt chunk to (module docstring; ``fed``: the requests given
        one in this iteration already), or None."""
        for r in self.admitting:
            if all(r is not f for f in fed):
                return r
        limit = self.config.max_running
        taken = len(self.running) + sum(r.spec.n for r in self.admitting)  # rows the admitted ones will join as
        with self.lock:
            if not self.queue or taken >= limit:
                return None
            if taken and taken + self.queue[0].spec.n > limit:
                return None  # its n choices wait for room (alone in an empty batch they may exceed it)
            r = self.queue.popleft()
            self.admitting.append(r)
            return r

    def joined(self, r: ActiveRequest, rows: list[ActiveRequest]) -> None:
        """``r``'s prompt is in: its rows that go on join the batch, in one step with ending its admission, so
        that ``in_flight`` (a drain) never misses it in between."""
        with self.lock:
            self.running.extend(row for row in rows if not row.done)
            self.admitting = [a for a in self.admitting if a is not r]

    def abandon(self, r: ActiveRequest) -> None:
        """``r``'s admission ended without it joining the batch."""
        self.joined(r, [])

    def keep_going(self, batch: list[ActiveRequest]) -> None:
        """After a step over ``batch``: the batch is its rows that have not ended."""
        self.running = [r for r in batch if not r.done]

    def take_queue(self) -> list[ActiveRequest]:
        """Empty the queue -> what it held (shutdown)."""
        with self.lock:
            queued, self.queue = list(self.queue), deque()
        return queued
