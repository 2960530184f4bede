"""Engine: the thread that owns the model runner and runs continuous batching.

One loop iteration:
  1. run queued commands (session create/get/list/close, tokenize, status), each on this thread
  2. drop running requests whose client cancelled or whose deadline passed
  3. admit queued requests while the batch has room: open or take the session, tokenize the input,
     prefill the new tokens, sample the first token
  4. one batched ``runner.decode`` over every running request (sessions may differ in length and
     method), sample each row's next token, stream it, finish those that hit a stop condition

Threading: ``submit`` and the command helpers are called from the asyncio thread; they touch only
the queue, the command list and the session table's membership / busy flags, all under ``_lock``.
Everything that touches the runner (and its sessions) runs on the engine thread.

A session serves one request at a time: ``submit`` marks it busy and a second request for it is
FAILED_PRECONDITION. The last sampled token of a turn is not yet in the KV cache; it is kept as the
session's ``pending`` token and fed at the start of the next turn.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from retopk_server.engine.observer import EngineObserver
from retopk_server.engine.requests import (
    EngineConfig,
    EngineError,
    ErrorCode,
    FinishReason,
    GenerationRequest,
    Timings,
    TokenEvent,
    Usage,
)
from retopk_server.engine.sessions import SessionRecord, common_prefix
from retopk_server.engine.stream import RequestStream
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling import Sampler, StopChecker

log = logging.getLogger("retopk_server.engine")


@dataclass
class SessionSnapshot:
    """A session's state as reported to callers (taken on the engine thread)."""

    session_id: str
    method: MethodSpec
    method_params: dict
    num_tokens: int
    kv_bytes: int
    method_state_bytes: int
    busy: bool
    turns: int
    created_unix: float
    last_used_unix: float


@dataclass
class EngineStatus:
    running: int
    queued: int
    sessions: int
    ephemeral_sessions: int
    draining: bool
    kv_bytes: int


class ActiveRequest:
    """A request inside the engine: its spec, its stream and the state of its generation."""

    def __init__(self, spec: GenerationRequest, stream: RequestStream, method: MethodSpec | None,
                 max_new_tokens: int) -> None:
        self.spec = spec
        self.stream = stream
        self.method = method  # None: the session's method (named session) or the default (resolved at admission)
        self.max_new_tokens = max_new_tokens
        self.arrived = time.monotonic()
        self.admitted = self.prefilled = self.first_token_at = 0.0
        self.record: SessionRecord | None = None
        self.prompt_ids: list[int] = []  # this request's new input tokens
        self.context_ids: list[int] = []  # everything in the cache after prefill (for the penalties)
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.last_token = -1
        self.prefill_s = 0.0
        self.sampler: Sampler | None = None
        self.stop: StopChecker | None = None
        self.done = False

    @property
    def session_id(self) -> str | None:
        return self.spec.session_id

    @property
    def ephemeral(self) -> bool:
        return self.spec.session_id is None

    def expired(self, now: float) -> bool:
        return self.spec.deadline is not None and now >= self.spec.deadline


class Engine:
    """Owns the runner on one thread; see the module docstring.

    runner_factory   builds the ModelRunner (called on the engine thread, so the model is loaded there)
    """

    def __init__(self, runner_factory: Callable[[], object], config: EngineConfig | None = None,
                 observer: EngineObserver | None = None) -> None:
        self.config = config or EngineConfig()
        self.observer = observer or EngineObserver()
        self._factory = runner_factory
        self.runner = None
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: deque[ActiveRequest] = deque()
        self._commands: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self._sessions: dict[str, SessionRecord] = {}
        self._running: list[ActiveRequest] = []
        self._admitting: ActiveRequest | None = None  # between the queue and the batch (prefilling)
        self._ephemeral = 0
        self._draining = False
        self._stop = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._describe_cache: dict[MethodSpec, dict] = {}

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
        with self._lock:
            self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    def in_flight(self) -> int:
        """Requests queued or running. A request counts as finished once its last event is out,
        even if the engine thread has not yet dropped it from the running batch."""
        with self._lock:
            live = {id(r) for r in [*self._running, self._admitting] if r is not None and not r.done}
            return len(self._queue) + len(live)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still queued or running end with UNAVAILABLE."""
        with self._wake:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ requests (asyncio thread)
    def submit(self, spec: GenerationRequest, stream: RequestStream) -> None:
        """Queue a request; raises EngineError (UNAVAILABLE, RESOURCE_EXHAUSTED, NOT_FOUND, FAILED_PRECONDITION)."""
        cfg = self.config
        max_new = cfg.default_max_new_tokens if spec.max_new_tokens is None else spec.max_new_tokens
        if not 0 < max_new <= cfg.max_new_tokens:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"max_new_tokens must lie in [1, {cfg.max_new_tokens}], got {max_new}")
        request = ActiveRequest(spec, stream, spec.method, max_new)
        with self._wake:
            if self._draining or self._stop:
                raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not accepting new requests")
            if len(self._queue) >= cfg.max_queue:
                raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                                  f"admission queue is full ({cfg.max_queue} requests waiting); retry later")
            if spec.session_id is not None:
                record = self._sessions.get(spec.session_id)
                if record is None:
                    raise EngineError(ErrorCode.NOT_FOUND, f"session_id: no session {spec.session_id!r}")
                if record.busy:
                    raise EngineError(ErrorCode.FAILED_PRECONDITION,
                                      f"session_id: session {spec.session_id!r} is busy with another request")
                record.busy = True
            self._queue.append(request)
            self._wake.notify_all()

    # ------------------------------------------------------------------ commands (asyncio thread)
    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._wake:
            if self._stop:
                future.set_exception(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down"))
                return future
            self._commands.append((fn, future))
            self._wake.notify_all()
        return future

    def create_session(self, session_id: str | None, method: MethodSpec | None) -> concurrent.futures.Future:
        return self.call(lambda: self._create_session(session_id, method))

    def get_session(self, session_id: str) -> concurrent.futures.Future:
        return self.call(lambda: self._snapshot(self._lookup(session_id)))

    def list_sessions(self) -> concurrent.futures.Future:
        return self.call(lambda: [self._snapshot(r) for r in list(self._sessions.values())])

    def close_session(self, session_id: str) -> concurrent.futures.Future:
        return self.call(lambda: self._close_session(session_id))

    def status(self) -> concurrent.futures.Future:
        return self.call(self._status)

    def describe_method(self, method: MethodSpec) -> dict:
        """Every hyperparameter of ``method`` (building it once per spec), without name and backend.

        Raises ValueError for an unknown method or bad hyperparameters. Safe on any thread: it builds
        a method object but touches no runner state.
        """
        if method not in self._describe_cache:
            described = dict(method.build().describe())
            described.pop("method", None)
            described.pop("backend", None)
            self._describe_cache[method] = described
        return dict(self._describe_cache[method])

    # ------------------------------------------------------------------ engine thread
    def _main(self) -> None:
        try:
            self.runner = self._factory()
        except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
            self._start_error = e
            self._ready.set()
            return
        self._hook("on_start", self.runner)
        self._ready.set()
        try:
            self._loop()
        finally:
            self._shutdown()

    def _loop(self) -> None:
        while True:
            self._run_commands()
            self._expire_idle_sessions()
            with self._wake:
                if self._stop:
                    return
                if not self._running and not self._queue and not self._commands:
                    self._wake.wait(self.config.idle_wait_s)
                    continue
            self._reap()
            self._admit()
            if self._running:
                self._step()
            self._hook("on_load", len(self._queue), len(self._running), len(self._sessions))

    def _hook(self, name: str, *args) -> None:
        try:
            getattr(self.observer, name)(*args)
        except Exception:  # a metrics bug must not take the engine down
            log.exception("observer hook %s failed", name)

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, future = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def _reap(self) -> None:
        now = time.monotonic()
        for r in list(self._running):  # a passed deadline also cancels the call: report it as the deadline
            if r.expired(now):
                self._fail(r, EngineError(ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded"))
            elif r.stream.cancelled:
                self._fail(r, EngineError(ErrorCode.CANCELLED, "request cancelled by the client"))
        self._running = [r for r in self._running if not r.done]

    def _admit(self) -> None:
        while len(self._running) < self.config.max_running:
            with self._lock:
                if not self._queue:
                    return
                r = self._queue.popleft()
                self._admitting = r
            try:
                self._admit_one(r)
            finally:
                with self._lock:
                    self._admitting = None

    def _admit_one(self, r: ActiveRequest) -> None:
        if r.expired(time.monotonic()):
            self._fail(r, EngineError(ErrorCode.DEADLINE_EXCEEDED, "deadline exceeded while queued"))
            return
        if r.stream.cancelled:
            self._fail(r, EngineError(ErrorCode.CANCELLED, "request cancelled by the client"))
            return
        try:
            self._prefill(r)
        except EngineError as e:
            self._fail(r, e)
        except Exception as e:
            log.exception("prefill of request %s failed", r.spec.request_id)
            self._fail(r, EngineError(ErrorCode.INTERNAL, f"prefill failed: {type(e).__name__}: {e}"))
        if not r.done:
            self._running.append(r)

    def _prefill(self, r: ActiveRequest) -> None:
        runner, spec = self.runner, r.spec
        r.admitted = time.monotonic()
        self._hook("on_queue_wait", r, r.admitted - r.arrived)
        if spec.session_id is None:
            r.method = r.method or runner.info.default_method
            try:
                session = runner.open_session(r.method, f"ephemeral-{uuid.uuid4().hex[:12]}")
            except ValueError as e:
                raise EngineError(ErrorCode.INVALID_ARGUMENT, f"method: {e}") from None
            r.record = SessionRecord(session, ephemeral=True)
            self._ephemeral += 1
            self._hook("on_session_opened", session.id, True)
        else:
            r.record = self._sessions[spec.session_id]  # busy, so nobody closed it
            r.method = r.record.session.method
        record, field = r.record, spec.input_field
        new_ids = self._input_ids(r)
        if not new_ids:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: the input has no tokens")
        limit = self.config.max_prompt_tokens or runner.info.max_context
        if len(new_ids) > limit:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"{field}: prompt too long: {len(new_ids)} tokens, the limit is {limit}")
        feed = record.pending + new_ids
        max_context = runner.info.max_context
        if record.session.length + len(feed) > max_context:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"{field}: prompt too long: {len(feed)} new tokens after {record.session.length} "
                              f"in the session exceed the context length {max_context}")
        t0 = time.monotonic()
        try:
            logits = runner.prefill(record.session, feed)  # (vocab,)
        except ValueError as e:  # ContextTooLong and friends, raised before the cache is touched
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: {e}") from None
        r.prefilled = time.monotonic()
        r.prefill_s = r.prefilled - t0
        record.pending = []
        r.prompt_ids = new_ids
        r.context_ids = list(record.session.token_ids)
        self._hook("on_prefill", r, len(feed), r.prefill_s)
        eos = set() if spec.ignore_eos else set(runner.info.eos_token_ids)
        r.sampler = Sampler(spec.sampling)
        r.stop = StopChecker(runner.tokenizer, sorted(eos | set(spec.stop_token_ids)), list(spec.stop))
        self._emit(r, r.sampler.sample(logits, r.generated, r.context_ids), None)

    def _input_ids(self, r: ActiveRequest) -> list[int]:
        """This request's new tokens (the session's pending token excluded)."""
        runner, spec, record = self.runner, r.spec, r.record
        if spec.text is not None:  # special tokens (a BOS) only at the start of a conversation
            return list(runner.encode(spec.text, add_special_tokens=record.num_tokens == 0))
        if spec.token_ids is not None:
            vocab = runner.info.vocab_size
            bad = [t for t in spec.token_ids if not 0 <= t < vocab]
            if bad:
                raise EngineError(ErrorCode.INVALID_ARGUMENT,
                                  f"token_ids: {bad[0]} is not a token id (vocab_size {vocab})")
            return list(spec.token_ids)
        try:
            if record.ephemeral:
                return list(runner.encode_chat(spec.chat))
            # The session remembers the conversation: render all of it and feed what the cache lacks.
            # Chat templates render earlier turns the same way, so the seen tokens are normally a prefix.
            full = list(runner.encode_chat(record.messages + spec.chat))
        except Exception as e:  # a template that rejects the messages (e.g. a bad role order)
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"chat: the chat template rejected the messages: {e}") from None
        # When the rendering differs from what was fed (a template that renders replies differently),
        # feed from the first difference on; the cache cannot be rewound.
        return full[common_prefix(full, record.seen_ids):]

    def _step(self) -> None:
        batch = list(self._running)
        want_stats = self.observer.wants_step_stats or any(r.spec.return_step_stats for r in batch)
        t0 = time.monotonic()
        try:
            logits, stats = self.runner.decode([r.record.session for r in batch], [r.last_token for r in batch],
                                               with_stats=want_stats)  # (B, vocab)
        except Exception as e:
            log.exception("batched decode of %d requests failed", len(batch))
            for r in batch:
                self._fail(r, EngineError(ErrorCode.INTERNAL, f"decode failed: {type(e).__name__}: {e}"))
            self._running = []
            return
        self._hook("on_step", batch, time.monotonic() - t0, stats)
        for i, r in enumerate(batch):
            token = r.sampler.sample(logits[i], r.generated, r.context_ids)
            self._emit(r, token, stats[i] if stats is not None else None)
        self._running = [r for r in batch if not r.done]

    def _emit(self, r: ActiveRequest, token: int, stats) -> None:
        """Stream one sampled token and finish the request if it hit a stop condition."""
        r.generated.append(token)
        r.last_token = token
        now = time.monotonic()
        if len(r.generated) == 1:
            r.first_token_at = now
            self._hook("on_first_token", r, now - r.arrived)
        self._hook("on_token", r)
        text, stopped = r.stop.push(token)
        reason = None
        if stopped:
            why = r.stop.stop_reason
            reason = (FinishReason.STOP_SEQUENCE if isinstance(why, str)
                      else FinishReason.STOP_TOKEN if why in r.spec.stop_token_ids else FinishReason.EOS_TOKEN)
        elif len(r.generated) >= r.max_new_tokens:
            reason = FinishReason.LENGTH
        elif r.record.session.length >= self.runner.info.max_context:  # no room to feed this token
            reason = FinishReason.CONTEXT_LENGTH
        if reason is not None and not stopped:
            text += r.stop.flush()
        r.text_parts.append(text)
        event = TokenEvent([token], text, token_index=len(r.generated) - 1,
                           step_stats=stats if r.spec.return_step_stats else None)
        if reason is None:
            r.stream.put(event)
            return
        end = time.monotonic()
        event.finish_reason = reason
        event.timings = Timings(queue_s=r.admitted - r.arrived, prefill_s=r.prefill_s,
                                time_to_first_token_s=r.first_token_at - r.arrived,
                                decode_s=end - r.first_token_at, total_s=end - r.arrived)
        self._release(r)  # before the last event: the caller's next turn must find the session free
        event.usage = Usage(prompt_tokens=len(r.prompt_ids), generated_tokens=len(r.generated),
                            session_tokens=r.record.num_tokens)
        event.session_id = "" if r.ephemeral else r.spec.session_id
        r.stream.put(event)
        self._hook("on_finish", r, reason.name, event.usage, event.timings)

    def _fail(self, r: ActiveRequest, error: EngineError) -> None:
        if r.done:
            return
        try:
            self._release(r)
        finally:
            r.stream.fail(error)
            self._hook("on_error", r, error.code.value)

    def _release(self, r: ActiveRequest) -> None:
        """End the request's hold on its session: remember the turn, close an ephemeral session."""
        r.done = True
        record = r.record
        if record is None:  # never admitted
            if not r.ephemeral:
                with self._lock:
                    named = self._sessions.get(r.spec.session_id)
                    if named is not None:
                        named.busy = False
            return
        if r.generated:
            record.pending = [r.last_token]
        if r.prefilled and r.spec.chat is not None and not record.ephemeral:
            record.messages = record.messages + list(r.spec.chat) + [
                {"role": "assistant", "content": "".join(r.text_parts)}]
        if r.prefilled:
            record.turns += 1
        record.last_used_unix = time.time()
        if record.ephemeral:
            self._ephemeral -= 1
            try:
                self.runner.close_session(record.session)
            finally:
                self._hook("on_session_closed", record.id, True)
        else:
            with self._lock:
                record.busy = False

    # --- session commands (engine thread) ------------------------------------------------------
    def _lookup(self, session_id: str) -> SessionRecord:
        record = self._sessions.get(session_id)
        if record is None:
            raise EngineError(ErrorCode.NOT_FOUND, f"session_id: no session {session_id!r}")
        return record

    def _create_session(self, session_id: str | None, method: MethodSpec | None) -> SessionSnapshot:
        if self._draining:
            raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not opening sessions")
        if session_id is not None and session_id in self._sessions:
            raise EngineError(ErrorCode.ALREADY_EXISTS, f"session_id: session {session_id!r} already exists")
        if len(self._sessions) >= self.config.max_sessions:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"too many sessions (max_sessions {self.config.max_sessions}); close one first")
        method = method or self.runner.info.default_method
        session_id = session_id or uuid.uuid4().hex
        try:
            session = self.runner.open_session(method, session_id)
        except ValueError as e:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"method: {e}") from None
        record = SessionRecord(session)
        with self._lock:
            self._sessions[session_id] = record
        self._hook("on_session_opened", session_id, False)
        return self._snapshot(record)

    def _close_session(self, session_id: str) -> SessionSnapshot:
        with self._lock:
            record = self._sessions.get(session_id)
            if record is None:
                raise EngineError(ErrorCode.NOT_FOUND, f"session_id: no session {session_id!r}")
            if record.busy:
                raise EngineError(ErrorCode.FAILED_PRECONDITION,
                                  f"session_id: session {session_id!r} is busy with a request")
            del self._sessions[session_id]
        snapshot = self._snapshot(record)
        self.runner.close_session(record.session)
        self._hook("on_session_closed", session_id, False)
        return snapshot

    def _expire_idle_sessions(self) -> None:
        """Close named sessions nobody used for ``session_idle_timeout_s`` (a client that vanished
        without closing them would otherwise hold their KV cache until max_sessions refuses everyone)."""
        timeout = self.config.session_idle_timeout_s
        if timeout is None:
            return
        cutoff = time.time() - timeout
        with self._lock:
            idle = [r for r in self._sessions.values() if not r.busy and r.last_used_unix < cutoff]
            for record in idle:
                del self._sessions[record.id]
        for record in idle:
            self.runner.close_session(record.session)
            self._hook("on_session_closed", record.id, False)
            log.info("session %s closed after %.0f s unused", record.id, timeout)

    def _snapshot(self, record: SessionRecord) -> SessionSnapshot:
        nbytes = record.session.nbytes()
        method = record.session.method
        try:
            params = self.describe_method(method)
        except ValueError:
            params = dict(method.params)
        return SessionSnapshot(session_id=record.id, method=method, method_params=params,
                               num_tokens=record.num_tokens, kv_bytes=int(nbytes.get("kv", 0)),
                               method_state_bytes=int(nbytes.get("method_state", 0)), busy=record.busy,
                               turns=record.turns, created_unix=record.created_unix,
                               last_used_unix=record.last_used_unix)

    def _status(self) -> EngineStatus:
        kv = sum(int(r.session.nbytes().get("kv", 0)) for r in self._sessions.values())
        kv += sum(int(r.record.session.nbytes().get("kv", 0)) for r in self._running if r.record and r.ephemeral)
        with self._lock:
            queued = len(self._queue)
        return EngineStatus(running=len(self._running), queued=queued, sessions=len(self._sessions),
                            ephemeral_sessions=self._ephemeral, draining=self._draining, kv_bytes=kv)

    def _shutdown(self) -> None:
        """Fail what is left, close every session, answer pending commands."""
        error = EngineError(ErrorCode.UNAVAILABLE, "server shut down before the request finished")
        for r in list(self._running):
            self._fail(r, error)
        self._running = []
        with self._lock:
            queued, self._queue = list(self._queue), deque()
            commands, self._commands = list(self._commands), deque()
        for r in queued:
            self._fail(r, error)
        for _, future in commands:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down"))
        for session_id in list(self._sessions):
            try:
                self.runner.close_session(self._sessions.pop(session_id).session)
            except Exception:
                log.exception("closing session %s at shutdown failed", session_id)
