"""Engine: the facade over one thread that owns the model runner, built by composition.

    Scheduler      scheduler.py     the queue, the request being admitted, the batch; each iteration's plan
    EngineLoop     loop.py          the engine thread's loop: runs the plan (admission.py, delivery.py)
    Supervision    supervision.py   wraps the loop: a loop that dies or hangs fails the engine (faults.py)
    SessionTable   session_table.py named and ephemeral sessions
    EngineCommands commands.py      sessions, tokenizer, status for other threads, as futures

Threading: ``submit`` and the commands are called from the asyncio thread; they touch only the queue,
the command queue and the session table's membership / busy flags, under the scheduler's lock.
Everything that touches the runner (and its sessions) runs on the engine thread.

A session serves one request at a time: ``submit`` marks it busy and a second request for it is
FAILED_PRECONDITION. The last sampled token of a turn is not yet in the KV cache; it is kept as the
session's ``pending`` token and fed at the start of the next turn (turn.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from retopk_server.engine import session_transfer
from retopk_server.engine.commands import CommandQueue, EngineCommands
from retopk_server.engine.delivery import Delivery
from retopk_server.engine.faults import EngineHung
from retopk_server.engine.idempotency import Answer, digest
from retopk_server.engine.loop import EngineLoop
from retopk_server.engine.observer import EngineObserver, hook_of
from retopk_server.engine.requests import EngineConfig, EngineError, ErrorCode, GenerationRequest
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.scheduler import Scheduler
from retopk_server.engine.session_table import SessionTable
from retopk_server.engine.stream import RequestStream
from retopk_server.engine.supervision import Supervision
from retopk_server.engine.turn import ActiveRequest
from retopk_server.runtime.constraints import ConstraintCompiler

log = logging.getLogger("retopk_server.engine")


class Engine:
    """Owns the runner on one thread; see the module docstring.

    runner_factory   builds the Runner (called on the engine thread, so the model is loaded there)
    commands         EngineCommands: sessions, tokenizer and status for other threads, as futures
    """

    def __init__(self, runner_factory: Callable[[], Runner], config: EngineConfig | None = None,
                 observer: EngineObserver | None = None) -> None:
        self.config = config or EngineConfig()
        self.observer = observer or EngineObserver()
        self._hook = hook_of(self.observer)
        self._factory = runner_factory
        self.runner: Runner | None = None
        self.scheduler = Scheduler(self.config)
        self._commands = CommandQueue(self.scheduler.lock)
        self.sessions = SessionTable(self.config, self._hook)
        self.commands = EngineCommands(self, self._commands)
        self.supervision = Supervision(self.scheduler, self._commands, self.config, self._hook)
        self._delivery = Delivery(self.sessions, self._hook)
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._constraints: ConstraintCompiler | None = None
        self._constraints_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle (any thread)
    def start(self) -> None:
        """Start the engine thread and wait until the runner is built; re-raises its failure."""
        self._thread = self.supervision.thread = threading.Thread(target=self._main, name="retopk-engine",
                                                                  daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            raise self._start_error

    @property
    def info(self):
        """The runner's ModelInfo (after ``start``)."""
        return self.runner.info

    @property
    def failure(self) -> BaseException | None:
        """Why the loop died (engine/faults.py), None while it runs."""
        return self.supervision.failure

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

    def check_artifact(self, artifact, owner: str = "") -> None:
        """The checks of importing a SessionArtifact for ``owner`` that need no session table
        (session_transfer.check_artifact): any thread, so that a large state's bounds are checked off the engine
        thread, which then imports it with ``commands.import_session(..., checked=True)``."""
        session_transfer.check_artifact(self.runner, artifact, owner)

    def start_drain(self) -> None:
        """Refuse new requests and sessions (UNAVAILABLE); queued and running ones go on."""
        with self.scheduler.lock:
            self.scheduler.draining = True

    @property
    def draining(self) -> bool:
        return self.scheduler.draining

    @property
    def alive(self) -> bool:
        """The engine thread runs its loop (False before ``start``, after ``stop`` and once it failed or hung)."""
        return (self._thread is not None and self._thread.is_alive() and self.failure is None
                and not self.scheduler.stopped)

    def in_flight(self) -> int:
        """Requests queued or running (Scheduler.in_flight)."""
        return self.scheduler.in_flight()

    def load(self) -> tuple[int, int]:
        """(queued, running) requests, the one being prefilled counted as running; exact on the engine
        thread, which alone changes the batch."""
        return self.scheduler.load()

    def check_hung(self) -> bool:
        """Any thread: True when the watchdog finds the loop hung now, the engine then failed (supervision.py)."""
        return self.supervision.check_hung()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still queued or running end with UNAVAILABLE."""
        with self.scheduler.lock:
            self.supervision.close()
        if self._thread is not None and not isinstance(self.failure, EngineHung):  # a hung thread does not end
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the engine thread to end (after ``stop`` or a failure)."""
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ requests (asyncio thread)
    def submit(self, spec: GenerationRequest, stream: RequestStream) -> None:
        """Queue a request the boundary checked (GenerationRequest.assert_checked, an AssertionError otherwise);
        raises EngineError (UNAVAILABLE, RESOURCE_EXHAUSTED, NOT_FOUND, FAILED_PRECONDITION)."""
        cfg = self.config
        spec.assert_checked(cfg.max_new_tokens)  # the boundary refused bad input; here only a bug can fail
        max_new = cfg.default_max_new_tokens if spec.max_new_tokens is None else spec.max_new_tokens
        with self.scheduler.lock:
            self.scheduler.check_open()
            if spec.session_id is not None:
                answer = self.sessions.answered(spec.session_id, spec.owner, spec.request_id, digest(spec))
                if answer is not None:
                    self._answer_again(spec, answer, stream)
                    return
                self.sessions.reserve(spec.session_id, spec.owner)
            r = ActiveRequest(spec, stream, max_new)
            self.scheduler.enqueue(r)
            stream.on_cancel = functools.partial(self._withdraw, r)

    def _withdraw(self, r: ActiveRequest) -> None:
        """The client of ``r`` cancelled (asyncio thread, RequestStream.cancel): a request still queued ends
        at once; an admitted one is dropped by the engine thread before its next chunk or step."""
        if self.scheduler.withdraw(r):
            self._delivery.fail(r, r.dropped(time.monotonic(), " while queued"))

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
        loop = EngineLoop(self.runner, self.scheduler, self.sessions, self._commands, self._delivery, self.config,
                          self.observer, self._hook)
        self.supervision.run(loop)
