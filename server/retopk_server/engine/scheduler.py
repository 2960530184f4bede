"""Engine: the thread that owns the model runner and runs continuous batching.

One loop iteration:
  1. run queued commands (``engine.commands``: sessions, tokenize, status; commands.py), on this thread,
     so a command waits for at most one iteration, never for a whole long prompt
  2. schedule: drop the requests whose client cancelled or whose deadline passed (running, queued, being
     prefilled), then feed prompts with the iteration's token budget (``max_step_tokens`` minus one token
     per running request): the next chunk of the request being admitted and, once it is in (its first
     token sampled, the request joins the batch), the next queued requests while the batch has room.
     Admission opens or takes the session and reserves KV blocks for the whole prompt (runner.start_prefill);
     under memory pressure idle sessions are evicted least recently used first (sessions.with_room), and
     a prompt that still does not fit is RESOURCE_EXHAUSTED
  3. run: reserve each running request's next KV block (same eviction rule), then one batched
     ``runner.decode`` over every running request (sessions may differ in length and method)
  4. postprocess: sample each row's next token, stream it, finish the requests that hit a stop condition

A queued request whose client cancels ends at once, from the asyncio thread (``RequestStream.cancel`` ->
``_withdraw``): its queue slot and its session's busy flag are free before the engine would reach it.

Threading: ``submit`` and the commands are called from the asyncio thread; they touch only the queue,
the command queue and the session table's membership / busy flags, under locks. Everything that
touches the runner (and its sessions) runs on the engine thread.

A session serves one request at a time: ``submit`` marks it busy and a second request for it is
FAILED_PRECONDITION. The last sampled token of a turn is not yet in the KV cache; it is kept as the
session's ``pending`` token and fed at the start of the next turn (turn.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from retopk_server.engine.commands import CommandQueue, EngineCommands
from retopk_server.engine.faults import (
    EngineFailed,
    EngineHung,
    cause,
    engine_failed_error,
    request_error,
    runner_broken,
)
from retopk_server.engine.observer import EngineObserver
from retopk_server.engine.requests import EngineConfig, EngineError, ErrorCode, GenerationRequest, TokenEvent
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.sessions import SessionTable
from retopk_server.engine.stream import RequestStream
from retopk_server.engine.supervision import Supervision
from retopk_server.engine.turn import ActiveRequest

log = logging.getLogger("retopk_server.engine")


class Engine(Supervision):
    """Owns the runner on one thread; see the module docstring. ``check_hung``: the watchdog (supervision.py).

    runner_factory   builds the Runner (called on the engine thread, so the model is loaded there)
    commands         EngineCommands: sessions, tokenizer and status for other threads, as futures
    """

    def __init__(self, runner_factory: Callable[[], Runner], config: EngineConfig | None = None,
                 observer: EngineObserver | None = None) -> None:
        self.config = config or EngineConfig()
        self.observer = observer or EngineObserver()
        self._factory = runner_factory
        self.runner: Runner | None = None
        self._wake = threading.Condition(threading.Lock())
        self._queue: deque[ActiveRequest] = deque()
        self._commands = CommandQueue(self._wake)
        self.sessions = SessionTable(self.config, self._hook)
        self.commands = EngineCommands(self, self._commands)
        self._running: list[ActiveRequest] = []
        self._admitting: ActiveRequest | None = None  # between the queue and the batch (prefilling)
        self._draining = False
        self._stop = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.failure: BaseException | None = None  # why the loop died (engine/faults.py), None while it runs
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle (any thread)
    def start(self) -> None:
        """Start the engine thread and wait until the runner is built; re-raises its failure."""
        self._thread = threading.Thread(target=self._main, name="retopk-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def info(self):
        """The runner's ModelInfo (after ``start``)."""
        return self.runner.info

    def start_drain(self) -> None:
        """Refuse new requests and sessions (UNAVAILABLE); queued and running ones go on."""
        with self._wake:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def alive(self) -> bool:
        """The engine thread runs its loop (False before ``start``, after ``stop`` and once it failed or hung)."""
        return self._thread is not None and self._thread.is_alive() and self.failure is None and not self._stop

    def in_flight(self) -> int:
        """Requests queued or running. A request counts as finished once its last event is out,
        even if the engine thread has not yet dropped it from the running batch."""
        with self._wake:
            live = {id(r) for r in [*self._running, self._admitting] if r is not None and not r.done}
            return len(self._queue) + len(live)

    def load(self) -> tuple[int, int]:
        """(queued, running) requests, the one being prefilled counted as running; exact on the engine
        thread, which alone changes the batch."""
        with self._wake:
            return len(self._queue), len(self._running) + (self._admitting is not None)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still queued or running end with UNAVAILABLE."""
        with self._wake:
            self._stop = self._commands.closed = True
            self._wake.notify_all()
        if self._thread is not None and not isinstance(self.failure, EngineHung):  # a hung thread does not end
            self._thread.join(timeout)

    # ------------------------------------------------------------------ requests (asyncio thread)
    def submit(self, spec: GenerationRequest, stream: RequestStream) -> None:
        """Queue a request; raises EngineError (UNAVAILABLE, RESOURCE_EXHAUSTED, NOT_FOUND, FAILED_PRECONDITION)."""
        cfg = self.config
        max_new = cfg.default_max_new_tokens if spec.max_new_tokens is None else spec.max_new_tokens
        if not 0 < max_new <= cfg.max_new_tokens:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"max_new_tokens must lie in [1, {cfg.max_new_tokens}], got {max_new}")
        spec.check_logprobs()
        with self._wake:
            if self._draining or self._stop:
                raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not accepting new requests")
            if len(self._queue) >= cfg.max_queue:
                raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                                  f"admission queue is full ({cfg.max_queue} requests waiting); retry later")
            if spec.session_id is not None:
                self.sessions.reserve(spec.session_id, spec.owner)
            r = ActiveRequest(spec, stream, max_new)
            self._queue.append(r)
            stream.on_cancel = functools.partial(self._withdraw, r)
            self._wake.notify_all()

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            self.runner = self.sessions.runner = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = e
            self._ready.set()
            return
        self._hook("on_start", self.runner.info, self.runner.memory)
        self._ready.set()
        error = EngineError(ErrorCode.UNAVAILABLE, "server shut down before the request finished")
        self._beat = time.monotonic()
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - the loop died: fail what is left, tell the supervisor
            self.failure = e
            log.critical("engine loop failed, the engine stops: %s", cause(e), exc_info=e)
            error = engine_failed_error(e)
        finally:
            with self._wake:  # from now on submit and the commands answer UNAVAILABLE
                self._stop = self._commands.closed = True
            self._shutdown(error)

    def _loop(self) -> None:
        while True:
            self._beat = time.monotonic()  # the watchdog's sign of progress (supervision.py)
            self._commands.run_pending()
            self.sessions.expire_idle()
            with self._wake:
                if self._stop:
                    return
                if not self._running and not self._queue and not self._commands and self._admitting is None:
                    self._wake.wait(self.config.idle_wait_s)
                    continue
            self._schedule()
            if self._running:
                self._reserve_decode()
            if self._running:
                self._run()
            self._hook("on_load", *self.load(), len(self.sessions))

    def _hook(self, name: str, *args) -> None:
        try:
            getattr(self.observer, name)(*args)
        except Exception:  # a metrics bug must not take the engine down
            log.exception("observer hook %s failed", name)

    # ---- schedule: drop the dead, feed prompts within the iteration's token budget ----------------------
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
        try:
            r.job = self.sessions.with_room(r.spec.input_field, runner.start_prefill, r.record.session, feed)
        except ValueError as e:  # ContextTooLong and friends, raised before the cache is touched
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{r.spec.input_field}: {e}") from None

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
            sampled = False
            try:
                self._prefilled(r, logits)
                sampled = True
            finally:
                with self._wake:  # in one step, so in_flight() (a drain) never misses the request in between
                    if sampled and not r.done:
                        self._running.append(r)
                    self._admitting = None
        return n

    def _prefilled(self, r: ActiveRequest, logits) -> None:
        r.prefilled = time.monotonic()
        r.record.pending = []
        r.context_ids = list(r.record.session.token_ids)
        self._hook("on_prefill", r, r.job.end - r.job.begin, r.prefill_s)
        r.job = None
        r.start_sampling(self.runner)
        self._step_row(r, logits, None)

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

    # ---- run: one batched decode step ------------------------------------------------------------------
    def _run(self) -> None:
        batch = list(self._running)
        want_stats = self.observer.wants_step_stats or any(r.spec.return_step_stats for r in batch)
        t0 = time.monotonic()
        try:
            logits, stats = self.runner.decode([r.record.session for r in batch], [r.last_token for r in batch],
                                               with_stats=want_stats)  # (B, vocab)
        except Exception as e:
            log.exception("batched decode of %d requests failed", len(batch))
            self._decode_alone(batch, want_stats, e)
            return
        self._hook("on_step", batch, time.monotonic() - t0, stats)
        for i, r in enumerate(batch):
            self._step_row(r, logits[i], stats[i] if stats is not None else None)
        self._running = [r for r in batch if not r.done]

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

    def _step_row(self, r: ActiveRequest, logits, stats) -> None:
        """Sample the request's next token from its logits (vocab,) and stream it. A failure ends this
        request alone, with a status that names the stage."""
        stage = "sampling"
        try:
            token = r.sampler.sample(logits, r.generated, r.context_ids)
            stage = "streaming the token"
            self._postprocess(r, token, stats)
        except Exception as e:
            log.exception("%s of request %s failed", stage, r.spec.request_id)
            self._fail(r, request_error(stage, e))

    # ---- postprocess: stream the token, finish the request ----------------------------------------------
    def _postprocess(self, r: ActiveRequest, token: int, stats) -> None:
        now = time.monotonic()
        event: TokenEvent = r.push(token, self.runner.info.max_context, stats)
        if len(r.generated) == 1:
            r.first_token_at = now
            self._hook("on_first_token", r, now - r.arrived)
        self._hook("on_token", r)
        if event.finish_reason is None:
            r.stream.put(event)
            return
        event.timings = r.timings(time.monotonic())
        self._release(r)  # before the last event: the caller's next turn must find the session free
        event.usage = r.usage()
        event.session_id = "" if r.ephemeral else r.spec.session_id
        r.stream.put(event)
        self._hook("on_finish", r, event.finish_reason.name, event.usage, event.timings)

    def _fail(self, r: ActiveRequest, error: EngineError) -> None:
        """End the request with ``error`` (unless its last event is out); a failed release is logged."""
        if r.stream.closed:
            return
        try:
            if not r.done:
                self._release(r)
        except Exception:
            log.exception("releasing the session of request %s failed", r.spec.request_id)
        finally:
            r.stream.fail(error)
            self._hook("on_error", r, error.code.value)

    def _release(self, r: ActiveRequest) -> None:
        """End the request's hold on its session: remember the turn, close an ephemeral session."""
        r.done = True
        if r.record is None:  # never admitted
            if not r.ephemeral:
                self.sessions.unreserve(r.session_id, r.spec.owner)
            return
        r.remember_turn()
        self.sessions.release(r.record)

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
