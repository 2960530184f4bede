"""Work handed to the engine thread from other threads, answered through futures.

    CommandQueue    the queue: ``call`` from any thread, ``run_pending`` on the engine thread
    EngineCommands  the commands themselves (sessions, tokenizer, status), ``engine.commands``

Session commands, tokenization and status touch the runner, which only the engine thread may use;
the loop runs the queued commands between decode steps.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from retopk_server.engine import session_transfer
from retopk_server.engine.requests import EngineError, ErrorCode
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.session_table import SessionSnapshot, SessionTable
from retopk_server.engine.turn import encode_chat
from retopk_server.runtime.method_spec import MethodSpec


class EngineView(Protocol):
    """What the commands read of the Engine (engine.py, which builds them with itself: this module names what it
    needs instead of importing engine.py back)."""

    sessions: SessionTable
    runner: Runner

    @property
    def draining(self) -> bool: ...

    def load(self) -> tuple[int, int]: ...


class CommandQueue:
    """``call`` (any thread) queues ``fn``; ``run_pending`` (engine thread) runs what is queued.

    ``lock`` is the engine's lock (a Condition's): the loop checks for commands under it before it sleeps.
    """

    def __init__(self, lock: threading.Condition) -> None:
        self._lock = lock
        self._queue: deque[tuple[Callable[[], object], concurrent.futures.Future]] = deque()
        self.closed = False

    def __bool__(self) -> bool:
        return bool(self._queue)

    def call(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run ``fn()`` on the engine thread between steps; the future holds its result or exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                future.set_exception(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down"))
                return future
            self._queue.append((fn, future))
            self._lock.notify_all()
        return future

    def run_pending(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    return
                fn, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def fail_pending(self) -> None:
        """Answer every queued command with UNAVAILABLE (shutdown)."""
        with self._lock:
            pending, self._queue = list(self._queue), deque()
        for _, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineError(ErrorCode.UNAVAILABLE, "server is shutting down"))


@dataclass
class EngineStatus:
    running: int
    queued: int
    sessions: int
    ephemeral_sessions: int
    draining: bool
    kv_bytes: int
    method_state_bytes: int = 0
    cache_budget_bytes: int = 0
    cache_reserved_bytes: int = 0
    sessions_evicted: int = 0


class EngineCommands:
    """What other threads ask of the engine besides ``submit``: sessions, tokenizer, status.

    Each command touches the runner or the session table, which belong to the engine thread, so it
    is queued on ``queue`` and answered through a future. The engine's instance is ``engine.commands``.
    """

    def __init__(self, engine: EngineView, queue: CommandQueue) -> None:
        self._engine = engine
        self._call = queue.call

    # Session commands act on ``owner``'s sessions only (the caller's key name, "" anonymous): another
    # owner's session id is NOT_FOUND, exactly as an id that never existed (session_table.py).
    def create_session(self, session_id: str | None, method: MethodSpec | None, owner: str = "",
                       max_owned: int | None = None) -> concurrent.futures.Future:
        def create() -> SessionSnapshot:
            if self._engine.draining:
                raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not opening sessions")
            return self._engine.sessions.create(session_id, method, owner, max_owned)

        return self._call(create)

    def get_session(self, session_id: str, owner: str = "") -> concurrent.futures.Future:
        return self._call(lambda: self._engine.sessions.get(session_id, owner))

    def list_sessions(self, owner: str = "") -> concurrent.futures.Future:
        return self._call(lambda: self._engine.sessions.snapshots(owner))

    def close_session(self, session_id: str, owner: str = "") -> concurrent.futures.Future:
        return self._call(lambda: self._engine.sessions.close(session_id, owner))

    def idle_sessions(self) -> concurrent.futures.Future:
        """(owner, id, bytes held) of every named session no request holds, most recently used first (to save or
        hand them over at a drain: service/handoff.py)."""
        return self._call(self._engine.sessions.idle_keys)

    def export_session(self, session_id: str, owner: str = "", close: bool = False) -> concurrent.futures.Future:
        """``owner``'s idle session as a SessionArtifact (engine/session_transfer.py); ``close`` moves it."""
        return self._call(lambda: session_transfer.export_session(self._engine.sessions, session_id, owner, close))

    def import_session(self, artifact, owner: str = "", session_id: str | None = None,
                       max_owned: int | None = None, evict: bool = True, checked: bool = False) \
            -> concurrent.futures.Future:
        """Open a SessionArtifact's session as ``owner``'s (engine/session_transfer.py) -> its SessionSnapshot;
        ``checked``: session_transfer.check_artifact passed already (off this thread)."""
        def run() -> SessionSnapshot:
            if self._engine.draining:
                raise EngineError(ErrorCode.UNAVAILABLE, "server is shutting down; not opening sessions")
            return session_transfer.import_session(self._engine.sessions, artifact, owner, session_id, max_owned,
                                                   evict, checked)

        return self._call(run)

    def make_room(self, sessions: list[tuple[int, MethodSpec | None]]) -> concurrent.futures.Future:
        """Grow the runner's pools once for sessions about to be imported (Runner.make_room)."""
        return self._call(lambda: self._engine.runner.make_room(sessions))

    def status(self) -> concurrent.futures.Future:
        return self._call(self._status)

    def encode(self, text: str) -> concurrent.futures.Future:
        """Token ids of ``text`` (with the tokenizer's special tokens)."""
        return self._call(lambda: self._engine.runner.encode(text))

    def encode_chat(self, messages: list[dict]) -> concurrent.futures.Future:
        """Token ids of a conversation in the chat template (INVALID_ARGUMENT if the template rejects it)."""
        return self._call(lambda: encode_chat(self._engine.runner, messages))

    def token_pieces(self, ids: list[int]) -> concurrent.futures.Future:
        """The tokenizer's piece for each token id."""
        return self._call(lambda: self._engine.runner.tokenizer.convert_ids_to_tokens(ids))

    def detokenize(self, ids: list[int], skip_special_tokens: bool) -> concurrent.futures.Future:
        return self._call(lambda: self._engine.runner.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def _status(self) -> EngineStatus:
        engine, sessions = self._engine, self._engine.sessions
        queued, running = engine.load()
        memory = engine.runner.memory()
        return EngineStatus(running=running, queued=queued, sessions=len(sessions),
                            ephemeral_sessions=sessions.ephemeral, draining=engine.draining,
                            kv_bytes=memory.kv_used, method_state_bytes=memory.method_state_used,
                            cache_budget_bytes=memory.budget,
                            cache_reserved_bytes=memory.kv_reserved + memory.method_state_reserved,
                            sessions_evicted=sessions.evictions)
