"""Admission: the way from the queue into the running batch, within each iteration's token budget.

A mixin of Engine (scheduler.py), on its state: the lock ``_wake``, the queue ``_queue`` (the asyncio
thread appends, under the lock), ``_admitting`` (the one request being prefilled), the batch ``_running``,
the runner and the session table; the engine thread calls it, but ``_withdraw``.

Scheduling one iteration (``_schedule``): drop the requests whose client cancelled or whose deadline
passed (running, queued, being prefilled), then feed prompts with the iteration's token budget
(``max_step_tokens`` minus one token per running request): the next chunk of the request being admitted
and, once it is in (its first token sampled, the request joins the batch), the next queued requests
while the batch has room. Admission opens or takes the session and reserves KV blocks for the whole
prompt (runner.start_prefill, which maps the blocks of its start that the prefix cache holds under the
request's namespace: its key and cache_salt, runtime/prefix_cache.py); under memory pressure idle
sessions are evicted least recently used first (sessions.with_room; the runner gave back the cache's
idle blocks before), and a prompt that still does not fit is RESOURCE_EXHAUSTED. Before the
decode step, ``_reserve_decode`` reserves each running request's next KV block by the same rule.

A queued request whose client cancels ends at once, from the asyncio thread (``RequestStream.cancel`` ->
``_withdraw``): its queue slot and its session's busy flag are free before the engine would reach it.
"""

from __future__ import annotations

import logging
import time

from retopk_server.engine.faults import request_error
from retopk_server.engine.requests import EngineError, ErrorCode
from retopk_server.engine.turn import ActiveRequest
from retopk_server.runtime.prefix_cache import namespace

log = logging.getLogger("retopk_server.engine")


class Admission:
    """Engine's scheduling of prompts (see the module docstring)."""

    def _schedule(self) -> None:
        """Drop the requests that were cancelled or ran past their deadline (running, queued, prefilling),
        then spend what the iteration's ``max_step_tokens`` leave after the batch's decode tokens (at least
        one) on prefill chunks: the prompt being fed, then the next queued requests while the batch has room."""
        now = time.monotonic()
        for r in self._running:
            if (error := r.dropped(now)) is not None:
                self._fail(r, error)
        self._running = [r for r in self._running if not r.done]
        self._drop_queued(now)
        budget = max(1, self.config.max_step_tokens - len(self._running))
        while budget > 0 and (r := self._admitting or self._admit_next()) is not None:
            budget -= self._prefill_chunk(r, budget)

    def _drop_queued(self, now: float) -> None:
        """Fail the queued requests whose client cancelled or whose deadline passed: their queue slot and
        session are free now, not when they would have been admitted."""
        with self._wake:
            dead = [r for r in self._queue if r.dropped(now) is not None]
            for r in dead:
                self._queue.remove(r)
        for r in dead:
            self._fail(r, r.dropped(now, " while queued"))

    def _withdraw(self, r: ActiveRequest) -> None:
        """The client of ``r`` cancelled (asyncio thread, RequestStream.cancel): a request still queued ends
        at once; an admitted one is dropped by the engine thread before its next chunk or step."""
        with self._wake:
            try:
                self._queue.remove(r)
            except ValueError:
                return
        self._fail(r, r.dropped(time.monotonic(), " while queued"))

    def _admit_next(self) -> ActiveRequest | None:
        """The next queued request, its session opened and its prefill started (blocks reserved for the
        whole prompt), while the batch has room; None when there is none or no room."""
        while len(self._running) < self.config.max_running:
            with self._wake:
                if not self._queue:
                    return None
                if self._running and len(self._running) + self._queue[0].spec.n > self.config.max_running:
                    return None  # its n choices wait for room (alone in an empty batch they may exceed it)
                r = self._admitting = self._queue.popleft()
            try:
                self._start_prefill(r)
                return r
            except EngineError as e:
                self._end_admission(r, e)
            except Exception as e:
                log.exception("prefill of request %s failed", r.spec.request_id)
                self._end_admission(r, request_error("prefill", e))
                self._check_runner(e)
        return None

    def _start_prefill(self, r: ActiveRequest) -> None:
        """Open or take the request's session and start feeding its tokens (runner.start_prefill): under
        memory pressure idle sessions are evicted first; a prompt that still does not fit is RESOURCE_EXHAUSTED."""
        runner = self.runner
        r.admitted = time.monotonic()
        if (error := r.dropped(r.admitted, " while queued")) is not None:
            raise error
        self._hook("on_queue_wait", r, r.admitted - r.arrived)
        if r.ephemeral:
            r.method = r.method or runner.info.default_method
            r.record = self.sessions.open_ephemeral(r.method)
        else:
            r.record = self.sessions.take(r.session_id, r.spec.owner)
            r.method = r.record.session.method
        feed = r.feed(runner, self.config.max_prompt_tokens)
        key = namespace(r.spec.owner, r.spec.cache_salt, self.config.prefix_cache_shared)
        try:
            r.job = self.sessions.with_room(r.spec.input_field, runner.start_prefill, r.record.session, feed, key)
        except ValueError as e:  # ContextTooLong and friends, raised before the cache is touched
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{r.spec.input_field}: {e}") from None
        r.cached_tokens = r.job.cached
        if r.job.looked_up:
            self._hook("on_prefix_lookup", r, r.job.looked_up, r.job.cached)

    def _prefill_chunk(self, r: ActiveRequest, budget: int) -> int:
        """Feed up to ``budget`` of the admitted request's prompt tokens -> how many; with the last one in,
        sample its first token and move it into the running batch."""
        if (error := r.dropped(time.monotonic(), " while prefilling")) is not None:
            self._end_admission(r, error)
            return 0
        n = min(budget, r.job.remaining)
        t0 = time.monotonic()
        try:
            logits = r.job.step(n)  # (vocab,) after the prompt's last token, else None
        except Exception as e:
            log.exception("prefill of request %s failed", r.spec.request_id)
            self._end_admission(r, request_error("prefill", e))
            self._check_runner(e)
            return n
        r.prefill_s += time.monotonic() - t0
        if logits is not None:
            rows = []
            try:
                rows = self._prefilled(r, logits)
            finally:
                with self._wake:  # in one step, so in_flight() (a drain) never misses the request in between
                    self._running.extend(row for row in rows if not row.done)
                    self._admitting = None
        return n

    def _prefilled(self, r: ActiveRequest, logits) -> list[ActiveRequest]:
        """The prompt is in: fork it into the request's n choices, sample each one's first token -> the rows
        that join the batch."""
        r.prefilled = time.monotonic()
        r.record.pending = []
        r.context_ids = list(r.record.session.token_ids)
        self._hook("on_prefill", r, r.job.end - r.job.begin, r.prefill_s)
        r.job = None
        rows = [r]
        if r.spec.n > 1:
            try:
                forks = self.sessions.with_room("n", self.runner.fork, r.record.session, r.spec.n - 1)
            except EngineError as e:
                self._fail(r, e)
                return []
            rows += [r.fork(self.sessions.adopt_ephemeral(s), i) for i, s in enumerate(forks, start=1)]
            r.stream.choices = len(rows)
        for row in rows:
            row.start_sampling(self.runner)
        for row in rows:
            self._step_row(row, logits, None)
        return rows

    def _end_admission(self, r: ActiveRequest, error: EngineError) -> None:
        """The request being admitted fails: its partial prefill is undone, then it ends with ``error``."""
        with self._wake:
            if self._admitting is r:
                self._admitting = None
        try:
            if r.job is not None:
                r.job.abort()
        except Exception:
            log.exception("undoing the prefill of request %s failed", r.spec.request_id)
        r.job = None
        self._fail(r, error)

    def _reserve_decode(self) -> None:
        """KV room for every running request's next token, evicting idle sessions under memory pressure; a
        request whose next block does not fit even then ends RESOURCE_EXHAUSTED (the others go on)."""
        for r in self._running:
            session = r.record.session
            try:
                self.sessions.with_room("decoding the next token", self.runner.reserve, session, session.length + 1)
            except EngineError as e:
                self._fail(r, e)
            except ValueError:  # past max_context: the decode step reports it
                pass
            except Exception as e:  # an allocation failure or a bug: this request alone ends (faults.py)
                log.exception("reserving the next KV block of request %s failed", r.spec.request_id)
                self._fail(r, request_error("reserving the next KV block", e))
        self._running = [r for r in self._running if not r.done]
