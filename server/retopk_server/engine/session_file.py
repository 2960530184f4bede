"""A session artifact as a file of --session-dir (engine/session_store.py) and on the wire: format 3, which loads
without copying.

ExportSession and the drain's handoff send a file's bytes; ImportSession reads them with ``Receiver`` into a file
in memory (engine/spool.py) that ``read`` then reads as any file. Format 1 (engine/session_artifact.py: the
magic, a header line, then a safetensors payload under a SHA-256) is what older servers sent and wrote; both paths
read it still. A file is format 3: the safetensors payload alone, so that the library opens it where it lies
(safetensors_parts.open_payload_file: the tensors map the file, and the import's write into the pools is the only
copy), its check first in the payload's own metadata:

    8 bytes   N, the safetensors header's length (a multiple of 8: the first byte is never format 1's "R")
    N bytes   {"__metadata__":{"retopk_check":"<16 hex digits: the file's bytes><8: its CRC-32>",
              "retopk_format":"3","retopk":"<format 1's metadata object>"},<the tensors' entries>}
    the rest  the tensors' bytes, as in format 1, except that an int64 field of the method state may be stored
              as int32 (``parts`` does so where every value fits; ReTopK's supports, positions below max_context,
              were a third of a session's bytes): the import's copy into the pool widens it exactly
              (SlotPool.write_slot)

The CRC-32 (zlib's) is of the whole file with its own 8 digits read as "00000000": a byte flipped anywhere (the
header, the conversation, the tensors) or a file cut short is refused before the library parses anything. It
replaces format 1's SHA-256, whose pass took as long as reading the file: the checksum guards against damage, not
against a forger, who can recompute either. Its pass lies in the first turn of a client coming back after a
restart and in a handoff: engine/parallel_crc.py hashes the file with ISA-L where installed, split over a few cores.

Versions read: 1 (an older server's files), 2 (format 3 with every tensor as the session holds it: a restart
across the upgrade keeps its sessions) and 3; a file of another version, or of no format, is refused naming why.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable

import torch

from retopk_server.engine import parallel_crc, session_artifact
from retopk_server.engine.safetensors_parts import PayloadError, open_payload_file, payload_parts
from retopk_server.engine.session_artifact import MAGIC, MAX_METADATA_BYTES, ArtifactError, SessionArtifact
from retopk_server.engine.spool import Spool
from retopk_server.runtime.method_spec import MethodSpec

FORMAT = 3
READS = ("2", "3")  # the payload-only versions this server reads (module docstring)
NARROW = torch.int32  # what an int64 field of the method state is stored as when its values fit
PREFIX = b'{"__metadata__":{"retopk_check":"'  # at byte 8: the check's digits follow
CHECK = 8 + len(PREFIX)  # where the 16 + 8 digits start
BLANK = b"0" * 8


def parts(artifact: SessionArtifact, narrow: bool = True) -> list[bytes | memoryview]:
    """The file's bytes in parts (the header, then views of the artifact's tensors); ``narrow=False`` stores every
    field as the session holds it (bench/session_load.py compares the two)."""
    tensors, meta = session_artifact.contents(artifact)
    if narrow:
        tensors = {name: _narrowed(t) if name.startswith("state.") else t for name, t in tensors.items()}
    metadata = {"retopk_check": "0" * 24, "retopk_format": str(FORMAT), "retopk": json.dumps(meta)}
    payload = payload_parts(tensors, metadata)
    head = bytearray(payload[0])
    if head[8:CHECK] != PREFIX:  # payload_parts writes the metadata first, its keys in order
        raise AssertionError("the safetensors header does not start with the check")
    head[CHECK:CHECK + 16] = b"%016x" % sum(len(p) for p in payload)
    crc = zlib.crc32(head)
    for part in payload[1:]:
        crc = parallel_crc.crc32(part, crc)
    head[CHECK + 16:CHECK + 24] = b"%08x" % crc
    return [bytes(head), *payload[1:]]


def _narrowed(t: torch.Tensor) -> torch.Tensor:
    """``t`` as NARROW when it is int64 and every value fits (module docstring), else ``t``."""
    if t.dtype != torch.long or not t.numel():
        return t
    lo, hi = torch.aminmax(t)
    info = torch.iinfo(NARROW)
    return t.to(NARROW) if info.min <= lo and hi <= info.max else t


def read(path: str | os.PathLike, limit: int | None = None, pause: Callable[[], None] | None = None) \
        -> SessionArtifact:
    """The artifact of the file at ``path``, of any version it reads (a narrowed field comes as int32; ``limit``:
    the file's most bytes); ArtifactError naming what is wrong. ``pause()``, when given, runs between the
    checksum's pass and the parse (a background load that lets a more urgent one go first)."""
    with open(path, "rb") as f:
        if f.read(1) == MAGIC[:1]:
            return session_artifact.read_file(path, limit, pause)
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise session_artifact.too_large(limit)
        crc = _checked_crc(f.fileno(), size)
        if pause is not None:
            pause()
        fd_path = f"/proc/self/fd/{f.fileno()}"  # the file checked, even if another replaced it at ``path`` since
        try:
            metadata, tensors = open_payload_file(fd_path if os.path.exists(fd_path) else os.fspath(path),
                                                  MAX_METADATA_BYTES)
        except PayloadError as e:
            raise ArtifactError("artifact", f"the tensors do not parse: {e}") from None
    if metadata.get("retopk_format") not in READS:
        raise session_artifact.UnsupportedFormat("artifact", f"file format {metadata.get('retopk_format')!r} is not "
                                                             f"supported (this server reads 1, {', '.join(READS)})")
    if metadata.get("retopk_check", "")[16:] != f"{crc:08x}":  # the digits the library parsed are the ones checked
        raise ArtifactError("artifact", "corrupted header (the check)")
    try:
        meta = json.loads(metadata["retopk"])
    except (ValueError, KeyError, TypeError):
        raise ArtifactError("artifact", "the payload carries no retopk metadata") from None
    return session_artifact.from_contents(meta, tensors)


def _checked_crc(fd: int, size: int) -> int:
    """The file's CRC-32 (module docstring), once its size is the one it states and the checksum matches."""
    if size < CHECK + 24:
        raise ArtifactError("artifact", f"truncated, or not a retopk session file ({size} bytes)")
    with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ) as m:
        if m[8:CHECK] != PREFIX:
            raise ArtifactError("artifact", "not a retopk session file (neither format 1's magic nor the check of "
                                            "formats 2 and 3 at its start)")
        digits = m[CHECK:CHECK + 24]
        try:
            stated, want = int(digits[:16], 16), int(digits[16:], 16)
        except ValueError:
            raise ArtifactError("artifact", "corrupted header (the check)") from None
        if size != stated:
            raise ArtifactError("artifact", f"truncated: {size} bytes, the file states {stated}" if size < stated
                                else f"corrupted: {size} bytes, more than the {stated} the file states")
        view = memoryview(m)
        try:
            crc = zlib.crc32(BLANK, zlib.crc32(view[:CHECK + 16]))
            crc = parallel_crc.crc32(view[CHECK + 24:], crc)  # the bulk, its parts on several cores
        finally:
            view.release()
    if crc != want:
        raise ArtifactError("artifact", "checksum mismatch: the payload is corrupted")
    return crc


def peek(path: str | os.PathLike) -> tuple[int, MethodSpec | None] | None:
    """(tokens, the method whose state it holds, None when it holds none) of a file of format 2 or 3, from its
    header alone, unchecked (sizing the pools before its load); None for a file of format 1 or one that does not
    parse (its load says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(CHECK)
            (n,) = struct.unpack("<Q", head[:8])
            if head[8:] != PREFIX or n > MAX_METADATA_BYTES:
                return None
            header = json.loads(head[8:] + f.read(n - len(PREFIX)))
        meta = json.loads(header["__metadata__"]["retopk"])
        length = int(header["token_ids"]["shape"][0])
        method = meta["method"]
        spec = MethodSpec(method["name"], tuple((str(k), v) for k, v in method["params"])) \
            if meta["has_state"] is True else None
        hash(spec)
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return None
    return length, spec


class Receiver:
    """An artifact of any version ``read`` reads, as its bytes arrive (ImportSession's chunks): ``feed`` each piece
    in order, then ``finish`` -> the SessionArtifact. One of format 1 (an older server's export: its magic first)
    goes to session_artifact.ArtifactReader; a file's bytes (what ExportSession and the drain's handoff send) to a
    Spool (engine/spool.py), which ``read`` then checks and parses as the file it is, the tensors mapping its pages.
    The size a file states is checked as soon as it is in (more than ``limit`` is refused before the rest
    arrives), and so is every byte past it; ``read`` checks the rest (truncation, the CRC-32, the format)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._format_1: session_artifact.ArtifactReader | None = None
        self._spool: Spool | None = None
        self._head = b""  # a file's first CHECK + 16 bytes, until they are in: they state its size
        self._size: int | None = None

    def feed(self, data) -> None:
        if self._format_1 is None and self._spool is None and len(data):
            if data[:1] == MAGIC[:1]:
                self._format_1 = session_artifact.ArtifactReader(self.limit)
            else:
                self._spool = Spool()
        if self._format_1 is not None:
            self._format_1.feed(data)
        elif self._spool is not None:
            self._take(data)

    def _take(self, data) -> None:
        if self._size is None:
            self._head += bytes(data[:CHECK + 16 - len(self._head)])
            if len(self._head) == CHECK + 16:
                self._size = self._stated()
        if self._size is not None and self._spool.size + len(data) > self._size:
            raise ArtifactError("artifact", f"corrupted: more bytes than the {self._size} the file states")
        self._spool.write(data)

    def _stated(self) -> int:
        if self._head[8:CHECK] != PREFIX:
            raise ArtifactError("artifact", "not a retopk session artifact (neither format 1's magic nor the check "
                                            "of formats 2 and 3 at its start)")
        try:
            size = int(self._head[CHECK:], 16)
        except ValueError:
            raise ArtifactError("artifact", "corrupted header (the check)") from None
        if self.limit is not None and size > self.limit:
            raise session_artifact.too_large(self.limit)
        return size

    def finish(self) -> SessionArtifact:
        try:
            if self._spool is None:  # format 1, or no byte at all (which its reader refuses)
                return (self._format_1 or session_artifact.ArtifactReader(self.limit)).finish()
            return read(self._spool.path, self.limit)
        finally:
            self.close()

    def close(self) -> None:
        """Drop what was received (``finish`` does so itself)."""
        if self._format_1 is not None:
            self._format_1.close()
        if self._spool is not None:
            self._spool.close()
            self._spool = None


def decode(data) -> SessionArtifact:
    """The artifact of ``data``, bytes of any version ``read`` reads (ExportSession's chunks joined)."""
    receiver = Receiver()
    receiver.feed(data)
    return receiver.finish()
