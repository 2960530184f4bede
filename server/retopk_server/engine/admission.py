"""Admission: the runner's side of the way from the queue into the batch (the scheduler picks who, this does it).

A request the scheduler hands out for the first time is admitted: its session is opened or taken and KV
blocks are reserved for its whole prompt (runner.start_prefill, which maps the blocks of its start that the
prefix cache holds under the request's namespace: its key and cache_salt, runtime/prefix_cache.py). Under
memory pressure idle sessions are evicted least recently used first (sessions.with_room; the runner gave
back the cache's idle blocks before), and a prompt that still does not fit is RESOURCE_EXHAUSTED. Then its
prompt is fed in chunks within each iteration's budget: ``admit`` says how many tokens a request gets in this
iteration, and ``feed`` runs every request's chunk of the iteration in shared forwards
(runner.prefill_together: the newcomers' short prompts in one forward, not one each). With the last chunk in,
the request forks into its n choices and each samples its first token and joins the batch.

Prompts that start alike. A prompt's blocks reach the prefix cache once its prefill is in, so two requests
that arrive together with a shared system prompt and were prefilled side by side would both miss it. A
first prompt that would take more of its start from the cache once a prefill under way (an admitted request's)
has cached its own (runner.waits_for_prefix: the cache's chain hashes, so the same namespace and tokens)
waits: it stays admitted with its session, nothing behind it is admitted in that iteration (first come, first
served), and it starts in a later one, after them. Prompts that share nothing cacheable still go together.

A failed admission or chunk ends that request alone (its partial prefill undone); an unexpected exception
then has the runner probed, and a broken runner ends the engine (faults.check_runner).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from retopk_server.engine.delivery import Delivery
from retopk_server.engine.faults import check_runner, request_error
from retopk_server.engine.requests import EngineConfig, EngineError
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.scheduler import Scheduler
from retopk_server.engine.session_table import SessionTable
from retopk_server.engine.turn import ActiveRequest
from retopk_server.runtime.prefix_cache import namespace

log = logging.getLogger("retopk_server.engine")


class Admission:
    """Admit a request and feed its prompt (see the module docstring)."""

    def __init__(self, runner: Runner, scheduler: Scheduler, sessions: SessionTable, delivery: Delivery,
                 config: EngineConfig, hook: Callable[..., None]) -> None:
        self.runner, self.scheduler, self.sessions, self.delivery = runner, scheduler, sessions, delivery
        self.config, self.hook = config, hook

    def admit(self, r: ActiveRequest, budget: int) -> int | None:
        """Admit ``r`` when it comes from the queue -> how many of its prompt tokens it gets in this iteration, at
        most ``budget`` (0 when its admission failed or it was dropped, and it ended), or None when its prompt
        waits for a prefill under way that will cache its start (module docstring): it stays admitted, with its
        session, and is started in a later iteration."""
        if r.job is None:
            try:
                if r.record is None:
                    self._open(r)
                elif (error := r.dropped(time.monotonic(), " while queued")) is not None:
                    raise error
                under_way = [a.job for a in self.scheduler.admitting if a.job is not None]
                if under_way and self.runner.waits_for_prefix(r.record.session, r.feed_ids, self._prefix_key(r),
                                                              under_way):
                    return None
                self._start(r)
            except EngineError as e:
                self.end(r, e)
                return 0
            except Exception as e:
                log.exception("prefill of request %s failed", r.spec.request_id)
                self.end(r, request_error("prefill", e))
                check_runner(self.runner, e)
                return 0
        if (error := r.dropped(time.monotonic(), " while prefilling")) is not None:
            self.end(r, error)
            return 0
        return min(budget, r.job.remaining)

    def feed(self, chunks: list[tuple[ActiveRequest, int]]) -> None:
        """Feed each admitted request its ``n`` prompt tokens of ``chunks`` (r, n) in shared forwards; a request
        whose prompt is in samples its first token and joins the batch, one whose chunk failed ends alone."""
        t0 = time.monotonic()
        try:
            results = self.runner.prefill_together([(r.job, n) for r, n in chunks])
        except Exception as e:  # not one job's failure: every request of the forward ends
            results = [e] * len(chunks)
        seconds = time.monotonic() - t0
        failed, raised = None, None
        for (r, _), out in zip(chunks, results, strict=True):
            if isinstance(out, BaseException):
                log.error("prefill of request %s failed", r.spec.request_id, exc_info=out)
                self.end(r, request_error("prefill", out))
                failed = out
                continue
            r.prefill_s += seconds  # each waited for the whole forward
            if out is not None:
                rows = []
                try:
                    rows = self._prefilled(r, out)
                except Exception as e:  # raised after every request of the forward has left admission
                    raised = raised or e
                finally:
                    self.scheduler.joined(r, rows)
        if failed is not None:
            check_runner(self.runner, failed)
        if raised is not None:
            raise raised

    def _open(self, r: ActiveRequest) -> None:
        """Open or take the request's session and render the tokens it feeds (``r.feed_ids``)."""
        runner = self.runner
        r.admitted = time.monotonic()
        if (error := r.dropped(r.admitted, " while queued")) is not None:
            raise error
        self.hook("on_queue_wait", r, r.admitted - r.arrived)
        if r.ephemeral:
            r.method = r.method or runner.info.default_method
            r.record = self.sessions.open_ephemeral(r.method)
        else:
            r.record = self.sessions.take(r.session_id, r.spec.owner)
            r.method = r.record.session.method
        # feed() refused what a client could get wrong (length, context); the runner's own checks are invariants
        r.feed_ids = r.feed(runner, self.config.max_prompt_tokens)

    def _prefix_key(self, r: ActiveRequest) -> bytes:
        return namespace(r.spec.owner, r.spec.cache_salt, self.config.prefix_cache_shared)

    def _start(self, r: ActiveRequest) -> None:
        """Start feeding the request's tokens (runner.start_prefill): under memory pressure idle sessions are
        evicted first; a prompt that still does not fit is RESOURCE_EXHAUSTED."""
        r.job = self.sessions.with_room(r.spec.input_field, self.runner.start_prefill, r.record.session, r.feed_ids,
                                        self._prefix_key(r))
        r.cached_tokens = r.job.cached
        if r.job.looked_up:
            self.hook("on_prefix_lookup", r, r.job.looked_up, r.job.cached)

    def _prefilled(self, r: ActiveRequest, logits) -> list[ActiveRequest]:
        """The prompt is in: fork it into the request's n choices, sample each one's first token -> the rows
        that join the batch."""
        r.prefilled = time.monotonic()
        r.record.pending = []
        r.context_ids = list(r.record.session.token_ids)
        self.hook("on_prefill", r, r.job.end - r.job.begin, r.prefill_s)
        r.job = None
        rows = [r]
        if r.spec.n > 1:
            try:
                forks = self.sessions.with_room("n", self.runner.fork, r.record.session, r.spec.n - 1)
            except EngineError as e:
                self.delivery.fail(r, e)
                return []
            rows += [r.fork(self.sessions.adopt_ephemeral(s), i) for i, s in enumerate(forks, start=1)]
            r.stream.choices = len(rows)
        for row in rows:
            row.start_sampling(self.runner)
        for row in rows:
            self.delivery.step_row(row, logits, None)
        return rows

    def end(self, r: ActiveRequest, error: EngineError) -> None:
        """The request being admitted fails: its partial prefill is undone, then it ends with ``error``."""
        self.scheduler.abandon(r)
        try:
            if r.job is not None:
                r.job.abort()
        except Exception:
            log.exception("undoing the prefill of request %s failed", r.spec.request_id)
        r.job = None
        self.delivery.fail(r, error)
