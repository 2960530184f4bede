"""--session-dir: session artifacts on disk, so that sessions outlive a restart.

One file per session, ``<sha256(owner NUL id)>.session``, holding its artifact (engine/session_file.py's
format, which carries the owner and the id again): the name needs no escaping and tells nothing about either. The
directory is made (or tightened) to mode 0700 and every file is created 0600, written to a temporary name
and renamed, so a reader never sees half a file. ``budget`` bounds the directory's bytes: after a write the
oldest files (by modification time, which is the session's last use) are deleted until the rest fit; an
artifact larger than the whole budget is not written. ``take`` reads a session's file (its tensors map it) and
deletes it: the session then lives in a server's memory again, and the
next drain writes it anew.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

from retopk_server.engine import session_file
from retopk_server.engine.session_artifact import SessionArtifact

log = logging.getLogger("retopk_server.engine")

SUFFIX = ".session"


class SessionStore:
    """Artifacts by (owner, session id) under ``directory``, at most ``budget`` bytes (module docstring)."""

    def __init__(self, directory: str | os.PathLike, budget: int) -> None:
        self.directory = Path(directory)
        self.budget = budget
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self.directory.stat().st_mode & 0o077:
            try:
                self.directory.chmod(0o700)  # readable by the server only, even on a volume made wider
            except OSError as e:  # a mount point the server does not own: its files are 0600 still
                log.warning("--session-dir %s: cannot make it 0700 (%s); its files are 0600", directory, e)

    def path(self, owner: str, session_id: str) -> Path:
        name = hashlib.sha256(f"{owner}\0{session_id}".encode()).hexdigest()
        return self.directory / (name + SUFFIX)

    def has(self, owner: str, session_id: str) -> bool:
        return self.path(owner, session_id).is_file()

    def save(self, owner: str, session_id: str, artifact: SessionArtifact) -> bool:
        """Write the artifact (session_file.py), replacing an older one, dated its ``last_used_unix`` (the
        session's last use: the oldest files, deleted first past the budget, are the sessions unused the longest)
        -> whether it was written (False: it alone exceeds the budget)."""
        parts = session_file.parts(artifact)
        last_used_unix = artifact.last_used_unix
        size = sum(len(p) for p in parts)
        if size > self.budget:
            log.warning("session %s/%s not saved: %d bytes exceed --session-dir-bytes %d", owner, session_id,
                        size, self.budget)
            return False
        path = self.path(owner, session_id)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask or a stale file said
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    f.write(part)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.utime(tmp, (last_used_unix, last_used_unix))
        tmp.replace(path)
        self._evict(keep=path)
        return True

    def take(self, owner: str, session_id: str, limit: int | None = None) -> SessionArtifact | None:
        """``owner``'s saved session ``session_id`` (``take_file``); None when there is none."""
        return self.take_file(self.path(owner, session_id), limit)

    def take_file(self, path: Path, limit: int | None = None, pause: Callable[[], None] | None = None) \
            -> SessionArtifact | None:
        """The artifact in ``path`` (read and checked: session_file.read, whose ArtifactError goes to the caller,
        ``pause`` called between the checksum and the parse), the file deleted either way; None when there is
        none."""
        try:
            return session_file.read(path, limit, pause)
        except FileNotFoundError:
            return None
        finally:
            path.unlink(missing_ok=True)

    def put_back(self, owner: str, session_id: str, artifact: SessionArtifact) -> None:
        """Undo a ``take`` whose import failed (the server cannot run it now; a later one may)."""
        self.save(owner, session_id, artifact)

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.directory.glob("*" + SUFFIX))

    def _evict(self, keep: Path) -> None:
        files = sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.budget:
                break
            if p != keep:
                total -= p.stat().st_size
                p.unlink(missing_ok=True)
                log.info("session file %s deleted: --session-dir-bytes %d reached", p.name, self.budget)
