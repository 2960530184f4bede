"""service/saved_sessions.py's order of work: a call's load goes first and the background preload yields to it,
and every load's checks run off the event loop and the engine thread. SavedSessions runs on a real SessionStore
around a stub engine that records what it is asked, and when; the reads are held by gates, so the order does not
depend on timing. The restart end to end: tests/server/test_session_keeping.py."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import weakref

import pytest
import torch

from retopk_server.engine.session_artifact import SessionArtifact
from retopk_server.engine.session_store import SessionStore
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.session_state import SessionState
from retopk_server.service import saved_sessions
from retopk_server.service.auth import Caller

pytestmark = pytest.mark.timeout(30)


class StubEngine:
    """What SavedSessions asks of the engine, recorded as (what, session id, thread name) in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []
        self.busy = False
        self.commands = self

    def in_flight(self) -> int:
        return int(self.busy)

    def check_artifact(self, artifact: SessionArtifact, owner: str) -> None:
        self.events.append(("check", artifact.session_id, threading.current_thread().name))

    def import_session(self, artifact, owner, session_id, max_owned, evict, checked):
        assert checked  # the checks ran before, off this thread
        self.events.append(("import", session_id, threading.current_thread().name))
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(None)
        return done

    def order(self) -> list[tuple[str, str]]:
        return [(what, sid) for what, sid, _ in self.events]


def save(store: SessionStore, session_id: str, used_unix: float) -> None:
    state = SessionState(MethodSpec("full"), torch.arange(4), torch.zeros(1, 1, 1, 4, 2), torch.zeros(1, 1, 1, 4, 2),
                         None)
    artifact = SessionArtifact(state=state, model={}, owner="", session_id=session_id, last_used_unix=used_unix)
    store.save("", session_id, artifact)


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """(SavedSessions over alpha and beta, beta used last; the stub engine; gates holding each file's read)."""
    monkeypatch.setattr(saved_sessions, "QUIET_S", 0.02)
    store = SessionStore(tmp_path / "sessions", 1 << 30)
    save(store, "alpha", 1000.0)
    save(store, "beta", 2000.0)
    engine = StubEngine()
    gates = {sid: threading.Event() for sid in ("alpha", "beta")}
    reading = {sid: threading.Event() for sid in ("alpha", "beta")}
    take = store.take_file

    def gated_take(path, limit=None, pause=None):
        sid = next(s for s in gates if store.path("", s) == path)
        reading[sid].set()
        assert gates[sid].wait(10)
        return take(path, limit, pause)

    store.take_file = gated_take
    return saved_sessions.SavedSessions(store, engine, 1 << 30, lambda name: Caller(name)), engine, gates, reading


async def until(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, 10)


def test_a_calls_load_goes_before_the_preload_it_interrupts(saved):
    sessions, engine, gates, reading = saved

    async def run():
        preload = asyncio.create_task(sessions.preload())
        await until(reading["beta"])  # the preload reads the most recently used file first
        call = asyncio.create_task(sessions.restore("", "alpha", None))
        await until(reading["alpha"])
        gates["beta"].set()  # beta's bytes are in while the call still waits for alpha's
        await asyncio.sleep(0.2)
        assert engine.order() == []  # the preload holds beta unchecked: a call waits for another file
        gates["alpha"].set()
        await call
        assert engine.order()[:2] == [("check", "alpha"), ("import", "alpha")]
        assert await preload == 1  # then the preload goes on with beta (alpha is the call's)
        return threading.current_thread().name

    loop_thread = asyncio.run(run())
    assert engine.order() == [("check", "alpha"), ("import", "alpha"), ("check", "beta"), ("import", "beta")]
    checks = {thread for what, _, thread in engine.events if what == "check"}
    assert loop_thread not in checks  # read, hashed, parsed and bounded in a worker thread
    assert os.listdir(sessions.store.directory) == []


def test_a_call_for_the_file_the_preload_holds_takes_it_over_at_once(saved):
    sessions, engine, gates, reading = saved

    async def run():
        preload = asyncio.create_task(sessions.preload())
        await until(reading["beta"])
        engine.busy = True  # a request runs from now on: the preload would wait for quiet to import beta
        gates["beta"].set()
        while engine.order() != [("check", "beta")]:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert engine.order() == [("check", "beta")]  # read and checked, held back from the engine thread
        await asyncio.wait_for(sessions.restore("", "beta", None), 5)  # beta's call: the import goes now
        assert engine.order() == [("check", "beta"), ("import", "beta")]
        preload.cancel()
        await sessions.stop()

    asyncio.run(run())
    assert [e for e in engine.order() if e[1] == "beta"] == [("check", "beta"), ("import", "beta")]  # once


def test_an_imported_files_tensors_are_let_go_off_the_calls_path(saved):
    """Once imported, the artifact's tensors (mapping the deleted file: the last reference unmaps it and frees
    its pages) are dropped on the low-priority thread, not on the event loop before the restored call goes on."""
    sessions, engine, gates, _ = saved
    for gate in gates.values():
        gate.set()
    dropped: list[str] = []
    imported = []
    record = engine.import_session

    def watched_import(artifact, *args, **kwargs):
        imported.append(artifact)
        weakref.finalize(artifact.state.k, lambda: dropped.append(threading.current_thread().name))
        return record(artifact, *args, **kwargs)

    engine.import_session = watched_import

    async def run():
        await sessions.restore("", "alpha", None)
        return threading.current_thread().name

    loop_thread = asyncio.run(run())
    deadline = time.monotonic() + 10
    while not dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped == ["retopk-drop"] and loop_thread != "retopk-drop"
    assert imported[0].state is None  # the artifact the engine's command held keeps no tensor
