"""--session-dir's sessions back in memory after a restart (engine/session_store.py holds the files).

Before the server takes calls, the engine's pools are grown once to hold the saved sessions (``make_room``). A
saved session comes back on its first use (``restore``, before the call that names it runs) and, from start-up
on, in the background (``preload``): the most recently used first, each imported only while it fits
the cache budget without evicting a session (the first that does not fit ends the preload; the rest wait on
disk for their first use). A client coming back after a restart then finds its session already in memory instead
of waiting for the file to be read, checked and imported before its turn.

A call's load goes first, the preload yields to it: the preload starts a file only once the server has been idle
(no request running, no call waiting for a saved session) for QUIET_S; its read pauses between reading the
bytes and checking them while a call waits for another file; and it imports what it read only after the same
quiet, since the import takes the engine thread from the decode steps. A call that waits for the very file the
preload holds makes the preload go on at once: that load is the call's. Every load reads, hashes, parses and
bounds the artifact off the event loop and off the engine thread (Engine.check_artifact); the engine thread only
allocates the session and copies the tensors in; a thread of the lowest priority lets go of them after
(``drop_off_path``).

Each file is loaded once: a call naming a session whose load is under way (a preload's or another call's)
waits for it. A file that does not parse is dropped; one this server cannot import now (limits, model setup)
goes back into the directory for a later try, and the call that asked for it gets the status. A session of
that id already open here makes the file stale: it is dropped. A preload opens each session for the owner its
artifact names (the key that saved it), only from a file stored under that owner and id, within that key's
session limit (a key at its limit keeps its other files on disk for their first use; a key no longer configured
keeps them too).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from retopk_server.engine import Engine, EngineError, session_artifact, session_file
from retopk_server.engine.requests import ErrorCode
from retopk_server.engine.session_store import SUFFIX, SessionStore
from retopk_server.engine.session_table import KEY_LIMIT
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.service.auth import Caller

log = logging.getLogger("retopk_server")

QUIET_S = 0.25  # idle time before each preloaded file: a client's next call in a burst of turns comes sooner


def drop_off_path(artifact: session_artifact.SessionArtifact) -> None:
    """Let go of an imported artifact's tensors on a thread of the lowest priority, not on the restored call's
    path: they map the file (engine/session_file.py), deleted once read, so the last reference unmaps it and
    frees its page cache, a few ms for a session of 1,000 tokens that its first turn need not wait for. The
    artifact keeps no tensor (the engine's command may hold it a moment longer)."""
    box = [artifact.state]
    artifact.state = None

    def drop() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # Linux: this thread alone
        except (AttributeError, OSError):
            pass
        box.clear()

    threading.Thread(target=drop, name="retopk-drop", daemon=True).start()


class SavedSessions:
    """See the module docstring. ``limit``: the largest artifact read (ModelInfo.limits.max_session_artifact_bytes);
    ``callers(name)``: the key of that name with its limits, None when there is none (KeyRing.caller)."""

    def __init__(self, store: SessionStore, engine: Engine, limit: int,
                 callers: Callable[[str], Caller | None]) -> None:
        self.store, self.engine, self.limit, self.callers = store, engine, limit, callers
        self._loads: dict[Path, asyncio.Future] = {}  # the file being loaded -> done when it is
        self._preload: asyncio.Task | None = None
        self.preloaded = 0
        self._wanted: dict[Path, int] = {}  # the files calls wait for -> how many calls
        self._turn = threading.Condition()  # guards _wanted and _stopping for the preload's thread
        self._stopping = False

    async def make_room(self) -> None:
        """Grow the engine's pools once for every saved session (Runner.make_room, within the cache budget), before
        the server takes calls: else the imports after a restart double them one after another, each doubling a
        copy of all the pools held, inside some session's first turn."""
        sessions = await asyncio.to_thread(self._saved_sizes)
        if not sessions:
            return
        try:
            await asyncio.wrap_future(self.engine.commands.make_room(sessions))
        except Exception as e:  # noqa: BLE001 - the sessions load without it, only slower
            log.warning("sizing the pools for %d saved sessions failed: %s", len(sessions), e)

    def _saved_sizes(self) -> list[tuple[int, MethodSpec | None]]:
        found = (session_file.peek(p) for p in self.store.directory.glob("*" + SUFFIX))
        return [size for size in found if size is not None]

    def start_preload(self) -> None:
        """``preload`` in the background (the server calls it once it accepts calls)."""
        self._preload = asyncio.get_running_loop().create_task(self.preload())

    async def stop(self) -> None:
        """No more preloading (a drain): the loads under way end first (a file is never left half taken; an
        import the draining engine refuses puts its file back)."""
        with self._turn:
            self._stopping = True  # a paused or quiet-waiting preload load goes on to its end
            self._turn.notify_all()
        if self._preload is not None:
            self._preload.cancel()
            await asyncio.gather(self._preload, return_exceptions=True)
        await asyncio.gather(*self._loads.values(), return_exceptions=True)

    async def restore(self, owner: str, session_id: str, max_owned: int | None) -> None:
        """Bring ``owner``'s saved session ``session_id`` back before a call uses it (nothing when none is saved);
        the import's EngineError when this server cannot open it now."""
        path = self.store.path(owner, session_id)
        self._want(path, 1)
        try:
            if path in self._loads:
                await asyncio.shield(self._loads[path])  # a preload of it (going on at once now): the file's fate
            if path.is_file():  # none under way, or a preload that left it (it did not fit without evicting)
                await self._load(path, owner, session_id, max_owned, evict=True)
        finally:
            self._want(path, -1)

    def _want(self, path: Path, calls: int) -> None:
        with self._turn:
            count = self._wanted.get(path, 0) + calls
            if count:
                self._wanted[path] = count
            else:
                del self._wanted[path]
            self._turn.notify_all()

    def _yield_to_calls(self, path: Path) -> None:
        """(The preload's thread, loading ``path``) Wait while calls wait for other files and none for this one."""
        with self._turn:
            self._turn.wait_for(lambda: self._stopping or path in self._wanted or not self._wanted)

    async def _quiet(self, path: Path | None = None) -> None:
        """Return once no request has run and no call has waited for a saved session for QUIET_S; at once when a
        call waits for ``path`` (the file the preload holds) or the preload stops."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        while loop.time() - since < QUIET_S:
            if self._stopping or (path is not None and path in self._wanted):
                return
            await asyncio.sleep(QUIET_S / 10)
            if self._wanted or self.engine.in_flight():
                since = loop.time()

    async def preload(self) -> int:
        """Import the saved sessions, most recently used first, while each fits without evicting -> how many."""
        def newest_first() -> list[Path]:
            files = []
            for p in self.store.directory.glob("*" + SUFFIX):
                try:
                    files.append((p.stat().st_mtime, p))
                except FileNotFoundError:  # restored meanwhile
                    continue
            return [p for _, p in sorted(files, reverse=True)]

        for path in await asyncio.to_thread(newest_first):
            await self._quiet()
            if path in self._loads or not path.is_file():
                continue
            try:  # shielded: a stop lets the load under way finish
                if not await asyncio.shield(self._load(path, None, None, None, evict=False)):
                    continue
            except EngineError as e:
                if e.code == ErrorCode.RESOURCE_EXHAUSTED and not e.message.startswith(KEY_LIMIT):
                    log.info("preloading saved sessions stopped: %s", e)
                    break
                continue  # a key at its session limit (KEY_LIMIT; a full server ends the preload), or another refusal
            self.preloaded += 1
        log.info("%d saved sessions preloaded from %s", self.preloaded, self.store.directory)
        return self.preloaded

    async def _load(self, path: Path, owner: str | None, session_id: str | None, max_owned: int | None,
                    evict: bool) -> bool:
        """Read, check and import the file at ``path`` (``owner`` None: a preload, for the owner the artifact
        names) -> whether a session was opened."""
        done = asyncio.get_running_loop().create_future()
        self._loads[path] = done
        try:
            return await self._read_and_import(path, owner, session_id, max_owned, evict)
        finally:
            del self._loads[path]
            done.set_result(None)

    async def _read_and_import(self, path: Path, owner: str | None, session_id: str | None, max_owned: int | None,
                               evict: bool) -> bool:
        preload = owner is None
        pause = functools.partial(self._yield_to_calls, path) if preload else None
        try:
            artifact = await asyncio.to_thread(self.store.take_file, path, self.limit, pause)
        except session_artifact.ArtifactError as e:
            log.warning("dropped the saved session file %s: %s", path.name, e)
            return False
        if artifact is None:
            return False
        if preload:
            owner, session_id = artifact.owner, artifact.session_id
            if self.store.path(owner, session_id) != path:  # not where this server saves that session
                log.warning("dropped the saved session file %s: it holds another session", path.name)
                return False
            caller = self.callers(owner)
            if caller is None:  # its key is gone (for now): the file stays
                await asyncio.to_thread(self.store.put_back, owner, session_id, artifact)
                return False
            max_owned = caller.max_sessions
        try:
            await asyncio.to_thread(self._check, artifact, owner, pause)
            if preload:
                await self._quiet(path)  # the import takes the engine thread: not from a request or a call's load
            await asyncio.wrap_future(self.engine.commands.import_session(artifact, owner, session_id, max_owned,
                                                                          evict, checked=True))
        except EngineError as e:
            if e.code != ErrorCode.ALREADY_EXISTS:  # else a session of that id is open here: the file is stale
                await asyncio.to_thread(self.store.put_back, owner, session_id, artifact)
                raise
            return False
        drop_off_path(artifact)
        log.info("session %s of %s restored from %s", session_id, owner or "anonymous", self.store.directory)
        return True

    def _check(self, artifact: session_artifact.SessionArtifact, owner: str, pause: Callable[[], None] | None) -> None:
        if pause is not None:
            pause()
        self.engine.check_artifact(artifact, owner)
