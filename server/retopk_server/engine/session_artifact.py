"""A session as a portable artifact: bytes that rebuild it on another server (or this one after a restart).

Format 1, the bytes in order:

    b"RETOPK-SESSION\\n"
    one JSON line: {"format": 1, "payload_bytes": N, "payload_sha256": "<hex>"} and b"\\n"
    the payload: N bytes, a safetensors file (https://github.com/huggingface/safetensors) holding
        token_ids   (L,) int64                     the tokens in the KV cache
        kv.k, kv.v  (layers, H_kv, L, d)           keys and values in the cache's dtype (runtime/session_state.py)
        state.<f>   (layers, ...)                  each field of the method's per-session state (absent: none yet)
    and in its ``__metadata__`` the key "retopk", a JSON object:
        model       the served model as ``model_fingerprint`` describes it; an import must match every entry
        method      {"name": ..., "params": [[name, value], ...]}: the session's MethodSpec
        owner, session_id, pending (token ids produced but not fed), messages (the chat so far), turns,
        created_unix, last_used_unix: the engine's SessionRecord (engine/session_table.py)

The checksum (SHA-256 of the payload) catches a truncated or corrupted artifact before anything parses it;
``decode`` then bounds every size and type (ArtifactError, the caller's INVALID_ARGUMENT) and
``check_model`` names what differs from the importing server (FAILED_PRECONDITION). A session keeps no
sampling state between turns (each Generate brings its own sampling and seed), so none is carried.
Servers before format 3 (engine/session_file.py) sent this over the wire and wrote it to --session-dir; they now send
and write format 3 and read this one still (session_file.Receiver, session_file.read).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch

from retopk_server.engine.safetensors_parts import PayloadError, open_payload_file, payload_parts
from retopk_server.engine.spool import Spool
from retopk_server.runtime.decoder.llama import compared_weight_format
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.session_state import SessionState

MAGIC = b"RETOPK-SESSION\n"
FORMAT = 1
MAX_HEADER_BYTES = 512  # the JSON line after the magic
MAX_METADATA_BYTES = 64 << 20  # the safetensors header: the conversation's text is the bulk of it
MAX_PENDING = 64  # tokens produced but not fed: one after a turn (the last sample)
READ_BYTES = 1 << 20  # a file's payload is read, hashed and spooled in pieces of this size
# What the model fingerprint lists (ModelInfo fields): an artifact moves only between servers equal in all of them.
MODEL_FIELDS = ("name", "architecture", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                "weight_format", "weight_bytes", "kv_dtype")


class ArtifactError(ValueError):
    """The bytes are not a well-formed artifact (truncated, corrupted, wrong checksum, bad field): ``field``
    names what is wrong ("artifact", "artifact.messages", ...)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def too_large(limit: int) -> ArtifactError:
    """The error of an artifact that states more than ``limit`` bytes."""
    return ArtifactError("data", f"the artifact exceeds {limit} bytes (ModelInfo.limits.max_session_artifact_bytes)")


class UnsupportedFormat(ArtifactError):
    """A well-formed artifact of another format version than this server reads."""


@dataclass
class SessionArtifact:
    """An artifact's contents (see the module docstring)."""

    state: SessionState
    model: dict
    owner: str
    session_id: str
    pending: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    created_unix: float = 0.0
    last_used_unix: float = 0.0


def model_fingerprint(info) -> dict:
    """The runner's ModelInfo entries an imported session depends on (MODEL_FIELDS), weight_format as
    ``compared_weight_format`` has it: float32, bf16x2 and int16 activations are one fingerprint, int8's another.

    Why a session moves between float32 and bf16x2 products: bf16x2 keeps each x to 2^-17 relative (two bf16
    limbs, |x - hi - lo| <= 2^-17 |x|), its products of bf16 are exact and its sums float32, so a product differs
    from float32's by at most about 2^-17 of sum_j |W_j x_j|. That is far below the rounding the session's keys and
    values take in a 16-bit KV cache (2^-11 relative in float16, the CPU's default; 2^-9 in bfloat16), and of the
    kind the same float32 products already differ by between servers: the fingerprint names no SIMD level, so an
    AVX2 server and an AVX-512 one (float32 block loops of 8 and 16 lanes, their sums in other orders) take each
    other's sessions, though
    bf16x2's differences are the larger (docs/bench/history.md, issue 28). A moved session is then no further
    from either server's own than one served on bf16x2 throughout, whose greedy tokens and perplexity were
    float32's (BENCHMARKS.md). int16 activations round x to half a step of 2^-15 of its block's largest value
    (2^-16 of it at most) and multiply exactly in integers, so a product differs from float32's by at most about
    sum_b 2^-16 max_j |x_bj| sum_j |W_bj|: the same league, also far below the 16-bit KV cache's rounding, and its
    greedy tokens and KJV perplexity were float32's too (docs/bench/history.md, 2026-12-07, helper h61); an AMD Zen 4
    server (int16 by default) and an AVX2 or an AMX one take each other's sessions. int8 activations round x to
    2^-8 of its block's largest value and flip greedy tokens, so they stay apart. Tests:
    tests/server/test_session_transfer.py (the fingerprints), tests/server/runtime/test_bf16x2_activations.py and
    test_int16_activations.py (a moved session continues as the one that never moved)."""
    fingerprint = {name: getattr(info, name) for name in MODEL_FIELDS}
    fingerprint["weight_format"] = compared_weight_format(fingerprint["weight_format"])
    return fingerprint


def check_model(artifact: SessionArtifact, info) -> str | None:
    """What differs between the artifact's model and ``info``'s (``"kv_dtype: bfloat16 here, float32 in the
    artifact; ..."``), or None when they match. The artifact's weight_format is compared as ``model_fingerprint``
    has it (an earlier server wrote bf16x2's or int16's whole)."""
    here, there = model_fingerprint(info), dict(artifact.model)
    if isinstance(there.get("weight_format"), str):
        there["weight_format"] = compared_weight_format(there["weight_format"])
    diffs = [f"{name}: {here[name]!r} here, {there.get(name)!r} in the artifact"
             for name in MODEL_FIELDS if there.get(name) != here[name]]
    return "; ".join(diffs) or None


def contents(artifact: SessionArtifact) -> tuple[dict[str, torch.Tensor], dict]:
    """(the payload's tensors, contiguous; its "retopk" metadata object) of ``artifact`` (module docstring)."""
    state = artifact.state
    tensors = {"token_ids": state.token_ids.contiguous(), "kv.k": state.k.contiguous(), "kv.v": state.v.contiguous()}
    for name, t in (state.state or {}).items():
        tensors[f"state.{name}"] = t.contiguous()
    meta = {"model": artifact.model, "method": {"name": state.method.name, "params": [list(p) for p in
                                                                                       state.method.params]},
            "owner": artifact.owner, "session_id": artifact.session_id, "pending": list(artifact.pending),
            "messages": artifact.messages, "turns": artifact.turns, "created_unix": artifact.created_unix,
            "last_used_unix": artifact.last_used_unix, "has_state": state.state is not None}
    return tensors, meta


def encode_parts(artifact: SessionArtifact) -> tuple[bytes | memoryview, ...]:
    """The artifact's bytes in parts, (magic and header line, the payload's parts: safetensors_parts.payload_parts,
    which view the artifact's tensors), whose concatenation is ``encode``'s."""
    tensors, meta = contents(artifact)
    payload = payload_parts(tensors, {"retopk": json.dumps(meta)})
    digest = hashlib.sha256()
    for part in payload:
        digest.update(part)
    header = {"format": FORMAT, "payload_bytes": sum(len(p) for p in payload), "payload_sha256": digest.hexdigest()}
    return (MAGIC + json.dumps(header).encode() + b"\n", *payload)


def encode(artifact: SessionArtifact) -> bytes:
    """The artifact's bytes (module docstring)."""
    return b"".join(encode_parts(artifact))


def chunks(parts: tuple[bytes | memoryview, ...], size: int):
    """The bytes of ``parts`` (``encode_parts``, session_file.parts) in pieces of at most ``size``: views of them,
    neither joined nor copied (the caller copies a piece into its message)."""
    for part in parts:
        view = memoryview(part).cast("B")
        for at in range(0, view.nbytes, size):
            yield view[at:at + size]


def decode(data) -> SessionArtifact:
    """Parse and check an artifact's bytes -> SessionArtifact; ArtifactError naming what is wrong."""
    reader = ArtifactReader()
    reader.feed(data)
    return reader.finish()


def read_file(path, limit: int | None = None, pause=None) -> SessionArtifact:
    """``decode`` of a file's artifact, its payload read in one piece; ``pause()``, when given, runs between the
    read and the checks (a background load that lets a more urgent one go first)."""
    reader = ArtifactReader(limit)
    with open(path, "rb") as f:
        reader.feed(f.readline(len(MAGIC)))  # the magic, then the header line: no payload byte comes with them
        reader.feed(f.readline(MAX_HEADER_BYTES + 1))
        reader.read_rest(f)
    if pause is not None:
        pause()
    return reader.finish()


class ArtifactReader:
    """An artifact read as its bytes arrive (ImportSession's chunks): ``feed`` each piece in order, then
    ``finish`` -> the SessionArtifact. The header is checked as soon as it is in (an artifact announcing more
    than ``limit`` payload bytes is refused before its payload arrives); the payload is hashed as it comes and
    written to a Spool (engine/spool.py), which the safetensors library parses once the checksum matched, its
    tensors mapping the spool's pages (safetensors_parts.open_payload_file)."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._head = b""  # the bytes before the payload, until the header line is complete
        self._digest = ""
        self._hash = hashlib.sha256()
        self._size: int | None = None  # the payload's bytes, once the header is in
        self._spool: Spool | None = None  # the payload so far, once the header is in
        self._received = 0

    def feed(self, data) -> None:
        if self._size is None:
            self._head += data
            data = self._header()
            if self._size is None:
                return
        self._take(data)

    def _take(self, data) -> None:
        n = memoryview(data).nbytes
        if self._received + n > self._size:
            raise ArtifactError("artifact", f"corrupted: more payload bytes than the {self._size} the header says")
        if n:
            self._hash.update(data)
            self._spool.write(data)
            self._received += n

    def read_rest(self, f) -> None:
        """Feed the rest of the binary file ``f`` (the payload in pieces of READ_BYTES)."""
        if self._size is None:
            return
        while self._received < self._size and (data := f.read(min(READ_BYTES, self._size - self._received))):
            self._take(data)  # short when truncated: finish says so
        if f.read(1):
            raise ArtifactError("artifact", f"corrupted: more payload bytes than the {self._size} the header says")

    def close(self) -> None:
        """Drop what was received (``finish`` does so itself)."""
        if self._spool is not None:
            self._spool.close()
            self._spool = None

    def _header(self) -> bytes:
        """Parse the header once it is in -> the payload bytes that came with it (b"" before)."""
        head = self._head
        if not MAGIC.startswith(head[:len(MAGIC)]):
            raise ArtifactError("artifact", "not a retopk session artifact (it must start with RETOPK-SESSION)")
        end = head.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER_BYTES)
        if end < 0:
            if len(head) >= len(MAGIC) + MAX_HEADER_BYTES:
                raise ArtifactError("artifact", "corrupted header (no line end)")
            return b""
        try:
            header = json.loads(head[len(MAGIC):end])
            version, size, digest = header["format"], header["payload_bytes"], header["payload_sha256"]
        except (ValueError, KeyError, TypeError):
            raise ArtifactError("artifact", "corrupted header (not the JSON line of format 1)") from None
        if version != FORMAT:
            raise UnsupportedFormat("artifact", f"format {version!r} is not supported (this server reads format "
                                                f"{FORMAT})")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
            raise ArtifactError("artifact", "corrupted header (payload_bytes, payload_sha256)")
        if self.limit is not None and size > self.limit:
            raise too_large(self.limit)
        self._digest, self._size, self._spool = digest, size, Spool()
        rest, self._head = head[end + 1:], b""
        return rest

    def finish(self) -> SessionArtifact:
        try:
            return self._finish()
        finally:
            self.close()

    def _finish(self) -> SessionArtifact:
        if self._size is None:
            if len(self._head) < len(MAGIC) or not self._head.startswith(MAGIC):
                raise ArtifactError("artifact", "not a retopk session artifact (it must start with RETOPK-SESSION)")
            raise ArtifactError("artifact", "truncated or corrupted header")
        if self._received != self._size:
            raise ArtifactError("artifact", f"truncated: {self._received} payload bytes, the header says "
                                            f"{self._size}")
        if self._hash.hexdigest() != self._digest:
            raise ArtifactError("artifact", "checksum mismatch: the payload is corrupted")
        try:
            metadata, tensors = open_payload_file(self._spool.path, MAX_METADATA_BYTES)
        except PayloadError as e:
            raise ArtifactError("artifact", f"the tensors do not parse: {e}") from None
        try:
            meta = json.loads(metadata["retopk"])
        except (ValueError, KeyError, TypeError):
            raise ArtifactError("artifact", "the payload carries no retopk metadata") from None
        return from_contents(meta, tensors)


def from_contents(meta: dict, tensors: dict[str, torch.Tensor]) -> SessionArtifact:
    """The artifact of a parsed payload's "retopk" metadata object and tensors (``contents``' inverse), every field
    checked: ArtifactError naming the first that is missing or wrong."""
    def need(name: str, kind):
        value = meta.get(name) if isinstance(meta, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
            raise ArtifactError(f"artifact.{name}", f"missing or not {getattr(kind, '__name__', kind)}")
        return value

    method = need("method", dict)
    try:
        spec = MethodSpec(method["name"], tuple((str(k), v) for k, v in method["params"]))
    except (KeyError, TypeError, ValueError):
        raise ArtifactError("artifact.method", "not a method name with [name, value] parameters") from None
    pending = need("pending", list)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in pending) or len(pending) > MAX_PENDING:
        raise ArtifactError("artifact.pending", f"at most {MAX_PENDING} token ids")
    messages = need("messages", list)
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in messages):
        raise ArtifactError("artifact.messages", "every message needs a string role and content")
    for name in ("token_ids", "kv.k", "kv.v"):
        if name not in tensors:
            raise ArtifactError("artifact", f"tensor {name!r} is missing")
    state = {k.removeprefix("state."): t for k, t in tensors.items() if k.startswith("state.")}
    session = SessionState(spec, tensors["token_ids"], tensors["kv.k"], tensors["kv.v"],
                           state if need("has_state", bool) else None)
    return SessionArtifact(state=session, model=need("model", dict), owner=need("owner", str),
                           session_id=need("session_id", str), pending=pending, messages=messages,
                           turns=need("turns", int), created_unix=float(need("created_unix", (int, float))),
                           last_used_unix=float(need("last_used_unix", (int, float))))
