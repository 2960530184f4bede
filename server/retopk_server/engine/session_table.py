"""The engine's sessions: SessionRecord (a runtime session plus its conversation) and SessionTable.

Named sessions live until closed (or idle past ``session_idle_timeout_s``) and serve one request at
a time; an ephemeral session is a request's own, opened at admission and closed when it ends.

Ownership: every named session belongs to the caller that created it (``owner``, a key's name from
service/auth.py; "" is the anonymous owner of dev mode). The table is keyed by (owner, id), so ids
are namespaced per owner (two keys may both name a session "chat1") and another owner's id is
simply absent: it gets the very NOT_FOUND of an id that never existed, by the same lookup. Ids the
server makes are 128 random bits (``secrets``).

Memory pressure: when the runner's cache budget refuses an allocation (BudgetExceeded), ``with_room``
evicts idle named sessions, least recently used first, and tries again; a request that still does not
fit is RESOURCE_EXHAUSTED. An evicted session's owner then gets NOT_FOUND saying it was evicted (each
owner's last EVICTED_REMEMBERED evictions are remembered for that message, so one busy key cannot push out
the records of the others).

Threading: ``reserve`` / ``unreserve`` run on the asyncio thread (from ``Engine.submit``) and touch
only membership and busy flags, under the table's lock; everything else runs on the engine thread,
the only one that adds or removes sessions.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from retopk_server.engine.idempotency import Answer, Answers
from retopk_server.engine.requests import EngineConfig, EngineError, ErrorCode
from retopk_server.engine.runner_protocol import Runner
from retopk_server.runtime.budget import BudgetExceeded
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.session import Session

log = logging.getLogger("retopk_server.engine")


@dataclass
class SessionRecord:
    """One session as the engine sees it.

    session     the runner's Session (KV blocks, method-state slots, ``token_ids`` in the cache)
    pending     tokens the model produced but has not yet fed back (the last sampled token of a turn);
                the next turn feeds them before its own input
    messages    the chat conversation so far (user turns and the server's replies), for chat input
    busy        a request holds the session (set at submission, cleared when the request ends)
    ephemeral   opened for one request and closed when it ends
    owner       the caller that created it ("" anonymous); with ``name`` its key in the table
    name        the id its owner knows it by ("": the runtime session's id, as for an ephemeral one)
    answers     its last turns by request id, so that a retried Generate is answered once (idempotency.py)
    """

    session: Session
    ephemeral: bool = False
    pending: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    busy: bool = False
    turns: int = 0
    created_unix: float = field(default_factory=time.time)
    last_used_unix: float = 0.0
    owner: str = ""
    name: str = ""
    answers: Answers = field(default_factory=Answers)

    def __post_init__(self) -> None:
        if not self.last_used_unix:
            self.last_used_unix = self.created_unix

    @property
    def id(self) -> str:
        """The id the owner knows the session by."""
        return self.name or self.session.id

    @property
    def key(self) -> tuple[str, str]:
        """(owner, id): the session's key in the table."""
        return self.owner, self.id

    @property
    def seen_ids(self) -> list[int]:
        """Every token of the conversation so far: in the cache, then pending."""
        return list(self.session.token_ids) + self.pending

    @property
    def num_tokens(self) -> int:
        return self.session.length + len(self.pending)

    @property
    def kv_bytes(self) -> int:
        return int(self.session.nbytes().get("kv", 0))


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


@functools.lru_cache(maxsize=256)
def _described(method: MethodSpec) -> tuple:
    described = dict(method.build().describe())
    described.pop("method", None)
    described.pop("backend", None)
    return tuple(described.items())


def describe_method(method: MethodSpec) -> dict:
    """Every hyperparameter of ``method`` (building it once per spec), without name and backend.

    Raises ValueError for an unknown method or bad hyperparameters. Safe on any thread: it builds
    a method object but touches no runner state.
    """
    return dict(_described(method))


def _not_found(session_id: str) -> EngineError:
    return EngineError(ErrorCode.NOT_FOUND, f"session_id: no session {session_id!r}")


EVICTED_REMEMBERED = 4096
KEY_LIMIT = "too many sessions for key"  # how a refusal for a key's own session limit begins


def _evicted(session_id: str) -> EngineError:
    return EngineError(ErrorCode.NOT_FOUND, f"session_id: session {session_id!r} was evicted to free cache memory "
                                            "(the server's kv_cache_bytes budget was full and it was the least "
                                            "recently used idle session); create a new session and replay the "
                                            "conversation")


def runtime_id(owner: str, session_id: str) -> str:
    """The runner's (unique) id of a named session: owner names have no "/" (service/auth.py)."""
    return f"{owner}/{session_id}" if owner else session_id


class SessionTable:
    """Named and ephemeral sessions of one runner.

    hook(name, *args)  reports ``on_session_opened`` / ``on_session_closed`` to the engine's observer
    """

    def __init__(self, config: EngineConfig, hook: Callable[..., None]) -> None:
        self.config = config
        self.runner: Runner | None = None  # bound by the engine thread once the runner is built
        self._hook = hook
        self._lock = threading.Lock()
        self._named: dict[tuple[str, str], SessionRecord] = {}  # (owner, id) -> record
        self._ephemeral: dict[str, SessionRecord] = {}
        self._evicted: dict[str, OrderedDict[str, None]] = {}  # owner -> ids of its recent evictions
        self._closing: list[SessionRecord] | None = None  # inside ``closing``: the ephemeral records to close
        self.evictions = 0

    def __len__(self) -> int:
        """Open named sessions."""
        return len(self._named)

    @property
    def ephemeral(self) -> int:
        return len(self._ephemeral)

    # ---- asyncio thread (Engine.submit) --------------------------------------------------------------
    def reserve(self, session_id: str, owner: str = "") -> None:
        """Mark ``owner``'s named session busy for a queued request; NOT_FOUND or FAILED_PRECONDITION."""
        with self._lock:
            self._idle(owner, session_id, "another request").busy = True

    def answered(self, session_id: str, owner: str, request_id: str, digest: str) -> Answer | None:
        """How ``owner``'s session answered the same request lately (idempotency.py), or None."""
        with self._lock:
            record = self._named.get((owner, session_id))
            return record.answers.get(request_id, digest) if record is not None else None

    def unreserve(self, session_id: str, owner: str = "") -> None:
        """Free a named session whose request ended before admission."""
        with self._lock:
            record = self._named.get((owner, session_id))
            if record is not None:
                record.busy = False

    # ---- engine thread -------------------------------------------------------------------------------
    def take(self, session_id: str, owner: str = "") -> SessionRecord:
        """The reserved named session of an admitted request (busy, so nobody closed it)."""
        return self._named[(owner, session_id)]

    def open_ephemeral(self, method: MethodSpec) -> SessionRecord:
        record = SessionRecord(self._open(method, f"ephemeral-{uuid.uuid4().hex[:12]}"), ephemeral=True)
        self._ephemeral[record.id] = record
        self._hook("on_session_opened", record.id, True)
        return record

    def adopt_ephemeral(self, session: Session) -> SessionRecord:
        """An ephemeral record of a session the runner already opened (a fork of a request's prompt, n > 1)."""
        record = SessionRecord(session, ephemeral=True)
        self._ephemeral[record.id] = record
        self._hook("on_session_opened", record.id, True)
        return record

    def release(self, record: SessionRecord) -> None:
        """A request's hold on the session ended: close an ephemeral session, free a named one."""
        record.last_used_unix = time.time()
        if record.ephemeral:
            del self._ephemeral[record.id]
            if self._closing is not None:
                self._closing.append(record)
                return
            try:
                self.runner.close_session(record.session)
            finally:
                self._hook("on_session_closed", record.id, True)
        else:
            with self._lock:
                record.busy = False

    @contextmanager
    def closing(self) -> Iterator[None]:
        """Inside, the ephemeral sessions ``release`` lets go of leave the table at once and their runner sessions
        close together when it ends (runner.close_sessions: the pools' upkeep once, not once a session), as a
        decode step's rows that end in it do. A failed close is logged (the requests' last events are out
        by then); nested, the outermost one closes."""
        if self._closing is not None:
            yield
            return
        self._closing = records = []
        try:
            yield
        finally:
            self._closing = None
            if records:
                try:
                    self.runner.close_sessions([r.session for r in records])
                except Exception:
                    log.exception("closing %d ended requests' sessions failed", len(records))
                finally:
                    for record in records:
                        self._hook("on_session_closed", record.id, True)

    def create(self, session_id: str | None, method: MethodSpec | None, owner: str = "",
               max_owned: int | None = None) -> SessionSnapshot:
        """Open a named session of ``owner``; ``max_owned`` bounds the sessions one owner may hold."""
        self.check_new(session_id, owner, max_owned)
        session_id = session_id or secrets.token_hex(16)
        record = SessionRecord(self._open(method or self.runner.info.default_method, runtime_id(owner, session_id)),
                               owner=owner, name=session_id)
        return self.adopt(record)

    def check_new(self, session_id: str | None, owner: str, max_owned: int | None) -> None:
        """ALREADY_EXISTS or RESOURCE_EXHAUSTED when ``owner`` may not open (or import) session ``session_id``."""
        if session_id is not None and (owner, session_id) in self._named:
            raise EngineError(ErrorCode.ALREADY_EXISTS, f"session_id: session {session_id!r} already exists")
        if max_owned is not None and self.owned(owner) >= max_owned:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"{KEY_LIMIT} {owner or 'anonymous'!r} "
                                                            f"(max_sessions {max_owned} per key); close one first")
        if len(self._named) >= self.config.max_sessions:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"too many sessions (max_sessions {self.config.max_sessions}); close one first")

    def adopt(self, record: SessionRecord) -> SessionSnapshot:
        """Add a named record whose runtime session is open (a created or an imported session)."""
        with self._lock:
            self._named[record.key] = record
            self._evicted.get(record.owner, {}).pop(record.id, None)
        self._hook("on_session_opened", record.id, False)
        return self.snapshot(record)

    def idle_keys(self) -> list[tuple[str, str, int]]:
        """(owner, id, bytes held) of every named session nobody holds, most recently used first (the likeliest to
        go on)."""
        with self._lock:
            idle = sorted((r for r in self._named.values() if not r.busy), key=lambda r: -r.last_used_unix)
            return [(*r.key, sum(r.session.nbytes().values())) for r in idle]

    def idle_record(self, session_id: str, owner: str = "") -> SessionRecord:
        """``owner``'s named session nobody holds (to export it); NOT_FOUND or FAILED_PRECONDITION."""
        with self._lock:
            return self._idle(owner, session_id, "a request")

    def close(self, session_id: str, owner: str = "") -> SessionSnapshot:
        with self._lock:
            record = self._idle(owner, session_id, "a request")
            del self._named[record.key]
        snapshot = self.snapshot(record)
        self.runner.close_session(record.session)
        self._hook("on_session_closed", session_id, False)
        return snapshot

    def get(self, session_id: str, owner: str = "") -> SessionSnapshot:
        record = self._named.get((owner, session_id))
        if record is None:
            raise self._missing(owner, session_id)
        return self.snapshot(record)

    def snapshots(self, owner: str | None = None) -> list[SessionSnapshot]:
        """Snapshots of ``owner``'s named sessions (None: everyone's), oldest first."""
        return [self.snapshot(r) for r in list(self._named.values()) if owner is None or r.owner == owner]

    def owned(self, owner: str) -> int:
        """Named sessions ``owner`` holds."""
        return sum(1 for o, _ in list(self._named) if o == owner)

    def kv_bytes(self) -> int:
        """KV bytes held by every open session, named and ephemeral."""
        return sum(r.kv_bytes for r in [*self._named.values(), *self._ephemeral.values()])

    def expire_idle(self) -> None:
        """Close named sessions nobody used for ``session_idle_timeout_s`` (a client that vanished
        without closing them would otherwise hold their KV cache until max_sessions refuses everyone)."""
        timeout = self.config.session_idle_timeout_s
        if timeout is None:
            return
        cutoff = time.time() - timeout
        with self._lock:
            idle = [r for r in self._named.values() if not r.busy and r.last_used_unix < cutoff]
            for record in idle:
                del self._named[record.key]
        for record in idle:
            self.runner.close_session(record.session)
            self._hook("on_session_closed", record.id, False)
            log.info("session %s closed after %.0f s unused", record.id, timeout)

    def close_all(self) -> None:
        """Shutdown: close every named session (ephemeral ones close with their requests)."""
        for key in list(self._named):
            try:
                self.runner.close_session(self._named.pop(key).session)
            except Exception:
                log.exception("closing session %s at shutdown failed", key)

    def snapshot(self, record: SessionRecord) -> SessionSnapshot:
        nbytes = record.session.nbytes()
        method = record.session.method
        try:
            params = describe_method(method)
        except ValueError:
            params = dict(method.params)
        return SessionSnapshot(session_id=record.id, method=method, method_params=params,
                               num_tokens=record.num_tokens, kv_bytes=int(nbytes.get("kv", 0)),
                               method_state_bytes=int(nbytes.get("method_state", 0)), busy=record.busy,
                               turns=record.turns, created_unix=record.created_unix,
                               last_used_unix=record.last_used_unix)

    def _idle(self, owner: str, session_id: str, holder: str) -> SessionRecord:
        """``owner``'s named session nobody holds (call under the lock); NOT_FOUND or FAILED_PRECONDITION."""
        record = self._named.get((owner, session_id))
        if record is None:
            raise self._missing(owner, session_id)
        if record.busy:
            raise EngineError(ErrorCode.FAILED_PRECONDITION,
                              f"session_id: session {session_id!r} is busy with {holder}")
        return record

    def _open(self, method: MethodSpec, session_id: str) -> Session:
        """A runner session of ``method``, which the boundary checked against the model (service/wire.py's
        method_spec, or an import's session_transfer): a ValueError from the runner here is a bug, not input."""
        return self.with_room("method", self.runner.open_session, method, session_id)

    # ---- memory pressure (engine thread) -----------------------------------------------------------
    def with_room(self, what: str, fn: Callable, *args):
        """``fn(*args)``, evicting idle named sessions (least recently used first) while the cache budget
        refuses it; RESOURCE_EXHAUSTED naming ``what`` when nothing is left to evict."""
        while True:
            try:
                return fn(*args)
            except BudgetExceeded as e:
                if e.need > e.free + self._reclaimable(e):  # evicting would only destroy sessions
                    raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"{what}: {e}; more than evicting every "
                                      "idle session could free: it does not fit the budget") from None
                if not self.evict_lru():
                    raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                                      f"{what}: {e}; no idle session is left to evict (the busy ones hold it)"
                                      ) from None

    def evict_lru(self) -> bool:
        """Close the least recently used idle named session to free its cache -> whether there was one."""
        with self._lock:
            idle = [r for r in self._named.values() if not r.busy]
            if not idle:
                return False
            record = min(idle, key=lambda r: r.last_used_unix)
            del self._named[record.key]
            remembered = self._evicted.setdefault(record.owner, OrderedDict())
            remembered[record.id] = None
            while len(remembered) > EVICTED_REMEMBERED:
                remembered.popitem(last=False)
        self.evictions += 1
        self.runner.close_session(record.session)
        self._hook("on_session_closed", record.id, False)
        self._hook("on_session_evicted", record.id)
        log.info("session %s evicted to free cache memory (%d tokens)", record.id, record.num_tokens)
        return True

    def _reclaimable(self, e: BudgetExceeded) -> int:
        """Bytes evicting every idle named session could make available to the refused allocation ``e``:
        their KV blocks, and for method state also the slots of sessions of the same method."""
        with self._lock:
            idle = [r.session for r in self._named.values() if not r.busy]
        kv = sum(s.nbytes()["kv"] for s in idle)
        if e.kv or e.method is None:
            return kv
        return kv + sum(s.nbytes()["method_state"] for s in idle if s.method == e.method)

    def _missing(self, owner: str, session_id: str) -> EngineError:
        """NOT_FOUND for ``owner``'s id: saying it was evicted when it was (call under the lock or on the
        engine thread)."""
        return _evicted(session_id) if session_id in self._evicted.get(owner, ()) else _not_found(session_id)
