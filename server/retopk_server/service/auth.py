"""API keys: who is calling. ``KeyRing.identify`` maps a presented key to a ``Caller`` or refuses.

Shared by every front (the gRPC servicer, the HTTP front): both read the same ``authorization:
Bearer <key>`` value and hand it to ``identify``. The caller's ``name`` owns the sessions it creates
(engine/session_table.py namespaces session ids by it); its limits bound its concurrent streams and open
sessions.

Keys file (``--api-keys-file``), one key per line; blank lines and ``#`` comments are ignored::

    # NAME:SHA256-HEX-OF-THE-KEY [max_streams=N] [max_sessions=N]
    alice:2bb80d537b1da3e38bd30361aa855686bde0eacd7162fef6a25fe97bf527a25b max_streams=4 max_sessions=8
    batch-jobs:fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9

NAME is 1-64 characters of letters, digits and ``_ . @ -``; limits absent on a line take the server's
``--max-streams-per-key`` / ``--max-sessions-per-key``, by default ``--key-share`` of the server's streams
and sessions (``ServerConfig.key_limits``). Only the
SHA-256 hashes are on disk and in memory (``retopk-server hash-key`` makes a line). A plain SHA-256 is
enough because keys are random tokens (``hash-key --generate`` makes one), not passwords.

Reload: SIGHUP (``serve`` wires it) or a change of the file's mtime/size, checked at most every
``check_interval_s`` on the next call. A file that does not parse on reload keeps the old keys and
logs the error; at startup it is an error.

No keys configured (no file, no ``--api-key``): dev mode, every call is the anonymous owner ("") and owns
everything, as before keys existed, within the same per-key limits (``KeyRing.anonymous``). The single
``--api-key`` is a key named ``default``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass

log = logging.getLogger("retopk_server.auth")

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")  # no "/": session keys are "<owner>/<name>"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
LIMITS = ("max_streams", "max_sessions")
SINGLE_KEY_NAME = "default"  # the name of --api-key's key
UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send metadata 'authorization: Bearer <key>'"


class Unauthenticated(Exception):
    """No key, or a key the server does not know (the message is the same either way)."""

    def __init__(self) -> None:
        super().__init__(UNAUTHENTICATED_MESSAGE)


class KeysFileError(ValueError):
    """The keys file cannot be read or parsed (the message names the file and line)."""


@dataclass(frozen=True)
class Caller:
    """Who is calling: ``name`` owns sessions ("" is the anonymous dev-mode owner); None limits: no per-key limit."""

    name: str
    max_streams: int | None = None
    max_sessions: int | None = None

    @property
    def label(self) -> str:
        return self.name or "anonymous"


ANONYMOUS = Caller("")


@dataclass(frozen=True)
class KeyEntry:
    caller: Caller
    digest: bytes  # sha256 of the key


def hash_key(key: str) -> str:
    """The SHA-256 hex digest the keys file stores for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


def generate_key() -> str:
    """A new random API key (256 bits, URL-safe)."""
    return "rtk-" + secrets.token_urlsafe(32)


def _limit(where: str, name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise KeysFileError(f"{where}: {name} must be a positive integer, got {text!r}")
    return value


def parse_keys(text: str, source: str = "keys file", defaults: dict | None = None) -> tuple[KeyEntry, ...]:
    """The entries of a keys file's text (see the module docstring); KeysFileError names the line."""
    defaults = defaults or {}
    entries: list[KeyEntry] = []
    names: set[str] = set()
    digests: set[bytes] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{number}"
        head, *options = line.split()
        name, sep, hexdigest = head.partition(":")
        if not sep or not NAME_RE.fullmatch(name):
            raise KeysFileError(f"{where}: expected NAME:SHA256HEX with NAME of 1-64 letters, digits, _ . @ -; "
                                f"got {head[:80]!r}")
        hexdigest = hexdigest.lower()
        if not _DIGEST_RE.fullmatch(hexdigest):
            raise KeysFileError(f"{where}: the hash of {name!r} must be 64 hex digits (sha256; "
                                "'retopk-server hash-key' makes it), not the key itself")
        limits = {k: defaults.get(k) for k in LIMITS}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in LIMITS:
                raise KeysFileError(f"{where}: unknown option {option[:40]!r}; expected "
                                    + " or ".join(f"{k}=N" for k in LIMITS))
            limits[key] = _limit(where, key, value)
        digest = bytes.fromhex(hexdigest)
        if name in names:
            raise KeysFileError(f"{where}: name {name!r} appears twice")
        if digest in digests:
            raise KeysFileError(f"{where}: the hash of {name!r} is also another name's (one key, one name)")
        names.add(name)
        digests.add(digest)
        entries.append(KeyEntry(Caller(name, **limits), digest))
    if not entries:
        raise KeysFileError(f"{source}: no keys (an empty keys file would lock every caller out)")
    return tuple(entries)


class KeyRing:
    """The keys the server accepts, from ``keys_file`` and/or the single ``api_key``; thread-safe.

    check_interval_s  how often (at most) a call stats the file to pick up a change (0: on every call;
                      None: never, only ``reload()`` / SIGHUP)
    """

    def __init__(self, keys_file: str | None = None, api_key: str | None = None, *,
                 max_streams: int | None = None, max_sessions: int | None = None,
                 check_interval_s: float | None = 2.0) -> None:
        self.keys_file = keys_file
        self.defaults = {"max_streams": max_streams, "max_sessions": max_sessions}
        self.check_interval_s = check_interval_s
        self.anonymous = Caller("", max_streams, max_sessions)  # every caller of a server without keys
        self._single = (KeyEntry(Caller(SINGLE_KEY_NAME, max_streams, max_sessions), hashlib.sha256(
            api_key.encode()).digest()),) if api_key else ()
        self._lock = threading.Lock()
        self._entries: tuple[KeyEntry, ...] = self._single
        self._stamp: tuple[int, int] | None = None
        self._next_check = 0.0
        if keys_file is not None:
            self._entries, self._stamp = self._load()  # at startup a bad file is an error

    @classmethod
    def from_config(cls, config) -> KeyRing:
        """The key ring of a ServerConfig (its api_keys_file, api_key and per-key limits: key_limits)."""
        max_streams, max_sessions = config.key_limits()
        return cls(getattr(config, "api_keys_file", None), config.api_key, max_streams=max_streams,
                   max_sessions=max_sessions)

    @property
    def enabled(self) -> bool:
        """False in dev mode (no keys): every call is ANONYMOUS."""
        return bool(self._entries)

    def names(self) -> list[str]:
        return [e.caller.name for e in self._entries]

    def caller(self, name: str) -> Caller | None:
        """The caller (and its limits) of the key named ``name``; the anonymous caller for "" on a server without
        keys; None when no key has that name (any longer)."""
        self.maybe_reload()
        entries = self._entries
        if not entries:
            return self.anonymous if name == "" else None
        return next((e.caller for e in entries if e.caller.name == name), None)

    # ---- identify ---------------------------------------------------------------------------------
    def identify(self, authorization: str | bytes | None) -> Caller:
        """The caller presenting ``authorization`` ("Bearer <key>"); raises Unauthenticated.

        Every configured key's hash is compared in constant time, with no early exit, so the time
        taken does not depend on which key (if any) matched.
        """
        self.maybe_reload()
        entries = self._entries
        if not entries:
            return self.anonymous
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        scheme, _, key = (authorization or "").strip().partition(" ")
        digest = hashlib.sha256(key.strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for entry in entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry.caller
        if found is None or scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated()
        return found

    # ---- reload -----------------------------------------------------------------------------------
    def maybe_reload(self) -> None:
        """Reload when the file's mtime or size changed (stat at most every check_interval_s)."""
        if self.keys_file is None or self.check_interval_s is None:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.check_interval_s
        try:
            stamp = self._file_stamp()
        except OSError:
            stamp = None
        if stamp != self._stamp:
            self.reload()

    def reload(self) -> bool:
        """Read the keys file again; on any error keep the current keys, log, and return False."""
        if self.keys_file is None:
            return True
        try:
            entries, stamp = self._load()
        except KeysFileError as e:
            log.error("keys file not reloaded, keeping the %d keys in use: %s", len(self._entries), e)
            try:
                self._stamp = self._file_stamp()  # do not retry an unchanged bad file on every call
            except OSError:
                self._stamp = None
            return False
        with self._lock:
            self._entries, self._stamp = entries, stamp
        log.info("keys file %s loaded: %d keys", self.keys_file, len(entries))
        return True

    def _file_stamp(self) -> tuple[int, int]:
        st = os.stat(self.keys_file)
        return st.st_mtime_ns, st.st_size

    def _load(self) -> tuple[tuple[KeyEntry, ...], tuple[int, int]]:
        try:
            stamp = self._file_stamp()
            with open(self.keys_file, encoding="utf-8") as f:
                text = f.read(1 << 20)  # 1 MiB: thousands of keys
        except (OSError, UnicodeDecodeError) as e:
            raise KeysFileError(f"cannot read keys file {self.keys_file}: {e}") from None
        entries = parse_keys(text, self.keys_file, self.defaults)
        if self._single:
            if any(e.caller.name == SINGLE_KEY_NAME for e in entries):
                raise KeysFileError(f"{self.keys_file}: the name {SINGLE_KEY_NAME!r} is --api-key's; "
                                    "use another name or drop --api-key")
            entries = self._single + entries
        return entries, stamp
