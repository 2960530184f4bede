"""Engine: the thread that owns the model runner and runs continuous batching.

One loop iteration:
  1. run queued commands (``engine.commands``: sessions, tokenize, status; commands.py), on this thread,
     so a command waits for at most one iteration, never for a whole long prompt
  2. schedule (admission.py): drop the cancelled and the expired requests, feed prompt chunks within the
     iteration's ``max_step_tokens``, admit queued requests while the batch has room, and reserve each
     running request's next KV block (evicting idle sessions under memory pressure)
  3. run: one batched ``runner.decode`` over every running request (sessions may differ in length and method)
  4. postprocess: sample each row's next token, stream it, finish the requests that hit a stop condition

A failure ends only the requests it hit; a broken runner, a dying or a hung loop (the watchdog) fail
the engine (supervision.py, faults.py).

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

from retopk_server.engine.admission import Admission
from retopk_server.engine.commands import CommandQueue, EngineCommands
from retopk_server.engine.faults import EngineHung, request_error
from retopk_server.engine.idempotency import Answer, digest
from retopk_server.engine.observer import EngineObserver
from retopk_server.engine.requests import EngineConfig, EngineError, ErrorCode, GenerationRequest, TokenEvent
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.sessions import SessionTable
from retopk_server.engine.stream import RequestStream
from retopk_server.engine.supervision import Supervision
from retopk_server.engine.turn import ActiveRequest
from retopk_server.runtime.constraints import ConstraintCompiler
from retopk_server.runtime.sampling import greedy_tokens

log = logging.getLogger("retopk_server.engine")


class Engine(Admission, Supervision):
    """Owns the runner on one thread; see the module docstring. Its scheduling of prompts (admission.py) and its
    failure handling, ``check_hung`` the watchdog included (supervision.py), are mixins on the same state.

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
        self._constraints: ConstraintCompiler | None = None
        self._constraints_lock = threading.Lock()

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

    def constraints(self) -> ConstraintCompiler:
        """The grammar compiler of the runner's tokenizer (any thread, after ``start``; built on first use, so a
        server that never sees a constraint never loads xgrammar)."""
        with self._constraints_lock:
            if self._constraints is None:
                info = self.runner.info
                try:
                    self._constraints = ConstraintCompiler(self.runner.tokenizer, info.vocab_size,
                                                           info.eos_token_ids, self.config.constraints)
                except Exception as e:  # a tokenizer xgrammar cannot read: no constraint can be served
                    log.exception("the grammar compiler cannot read this model's tokenizer")
                    raise EngineError(ErrorCode.FAILED_PRECONDITION, "constraint: this model's tokenizer cannot "
                                      f"drive the grammar compiler ({type(e).__name__}); constraints are "
                                      "unavailable on this server") from None
            return self._constraints

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
        spec.check_n()
        if spec.constraint is not None and spec.grammar is None:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "constraint: not compiled (Engine.constraints().compile)")
        with self._wake:
            if self._draining or self._stop:
                raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not accepting new requests")
            if len(self._queue) >= cfg.max_queue:
                raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                                  f"admission queue is full ({cfg.max_queue} requests waiting); retry later")
            if spec.session_id is not None:
                answer = self.sessions.answered(spec.session_id, spec.owner, spec.request_id, digest(spec))
                if answer is not None:
                    self._answer_again(spec, answer, stream)
                    return
                self.sessions.reserve(spec.session_id, spec.owner)
            r = ActiveRequest(spec, stream, max_new)
            self._queue.append(r)
            stream.on_cancel = functools.partial(self._withdraw, r)
            self._wake.notify_all()

    @staticmethod
    def _answer_again(spec: GenerationRequest, answer: Answer, stream: RequestStream) -> None:
        """A retry of a turn the session ran lately (engine/idempotency.py): its events again, or why not."""
        if not answer.events:
            raise EngineError(ErrorCode.FAILED_PRECONDITION,
                              f"request_id: request {spec.request_id!r} already ran in session {spec.session_id!r} "
                              f"and ended early ({answer.error}) after {answer.kept} tokens, which the session "
                              "keeps; send the next turn with a new request_id")
        for event in answer.events:
            stream.put(event)

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
        self._supervise(self._loop)  # supervision.py: a loop that dies fails the engine

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

    # ---- run: one batched decode step ------------------------------------------------------------------
    def _run(self) -> None:
        batch = list(self._running)
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
        self._hook("on_step", batch, time.monotonic() - t0, stats)
        try:
            greedy = greedy_tokens([r.sampler for r in batch], logits)  # the plain greedy rows in one argmax
        except Exception:  # then each row samples on its own, and a failure there ends that row alone
            log.exception("the batched argmax of %d rows failed", len(batch))
            greedy = {}
        for i, r in enumerate(batch):
            self._step_row(r, logits[i], stats[i] if stats is not None else None, greedy.get(i))
        self._running = [r for r in batch if not r.done]

    def _step_row(self, r: ActiveRequest, logits, stats, token: int | None = None) -> None:
        """Sample the request's next token from its logits (vocab,) unless ``token`` is it already, and stream
        it. A failure ends this request alone, with a status that names the stage."""
        stage = "sampling"
        try:
            if token is None:
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
        if not r.ephemeral:
            r.events.append(event)
        if event.finish_reason is None:
            r.stream.put(event)
            return
        event.timings = r.timings(time.monotonic())
        self._release(r)  # before the last event: the caller's next turn must find the session free
        event.usage = r.usage()
        event.session_id = "" if r.ephemeral else r.spec.session_id
        if not r.ephemeral:
            r.record.answers.remember(r.spec.request_id, Answer(digest(r.spec), events=r.events))
        r.stream.put(event)
        self._hook("on_finish", r, event.finish_reason.name, event.usage, event.timings)

    def _fail(self, r: ActiveRequest, error: EngineError) -> None:
        """End the request with ``error`` (unless its last event is out); a failed release is logged. A choice
        of an n > 1 request whose stream another choice's failure already ended just lets go of its session."""
        if r.done and r.stream.closed:
            return
        try:
            if not r.done:
                self._release(r)
        except Exception:
            log.exception("releasing the session of request %s failed", r.spec.request_id)
        finally:
            if not r.stream.closed:
                if r.events and r.record is not None and not r.ephemeral:  # tokens out: the session keeps them
                    r.record.answers.remember(r.spec.request_id, Answer(
                        digest(r.spec), error=f"{error.code.value}: {error.message}", kept=len(r.generated)))
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

