"""engine/session_file.py, --session-dir's format 3: a session round-trips exactly (every tensor's values, every
field; an int64 field of the method state whose values fit comes back int32, the rest in their own dtype), files
of formats 1 and 2 still load, and a damaged, cut, foreign or future file is refused naming why. That a narrowed
state imports exactly is in tests/server/runtime/test_runtime_session_state.py; the server-level drops of damaged
files are in tests/server/test_session_keeping.py."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
import zlib

import pytest
import torch

from retopk_server.engine import parallel_crc, session_artifact, session_file
from retopk_server.engine.safetensors_parts import payload_parts
from retopk_server.engine.session_artifact import ArtifactError, SessionArtifact, UnsupportedFormat
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.session_state import SessionState

SPEC = MethodSpec.of("retopk", top_k=8, cache_size=4)


def artifact() -> SessionArtifact:
    g = torch.Generator().manual_seed(0)
    kv = (2, 3, 2, 4, 8)  # (layers, blocks, KV heads, P, d)
    state = {"queries": torch.randn(2, 6, 4, 8, generator=g),
             "support": torch.randint(-1, 10, (2, 6, 4, 8), generator=g), "fill": torch.tensor([4, 3]),
             "step": torch.tensor([2**40, 3]), "tau": torch.randn(2, 6, generator=g)}
    return SessionArtifact(
        state=SessionState(SPEC, torch.randint(0, 100, (10,), generator=g), torch.randn(kv, generator=g).bfloat16(),
                           torch.randn(kv, generator=g).bfloat16(), state),
        model={"name": "m", "num_layers": 2}, owner="alice", session_id="s1", pending=[7],
        messages=[{"role": "user", "content": 'quotes " \\ and é'}], turns=3, created_unix=1.5, last_used_unix=2.5)


def written(tmp_path, art: SessionArtifact | None = None, name: str = "f.session"):
    path = tmp_path / name
    path.write_bytes(b"".join(bytes(p) for p in session_file.parts(art or artifact())))
    return path


def tensors_of(art: SessionArtifact) -> dict[str, torch.Tensor]:
    return session_artifact.contents(art)[0]


NARROWED = {"state.support", "state.fill"}  # artifact()'s int64 state fields whose values fit int32 ("step" does not)


def assert_same(got: SessionArtifact, want: SessionArtifact, narrowed: set[str] = NARROWED) -> None:
    fields = [f.name for f in dataclasses.fields(SessionArtifact) if f.name != "state"]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.state.method == want.state.method
    a, b = tensors_of(got), tensors_of(want)
    assert set(a) == set(b)
    for name, t in b.items():
        dtype = torch.int32 if name in narrowed else t.dtype
        assert a[name].dtype == dtype and torch.equal(a[name].to(t.dtype), t), name


def test_a_session_round_trips_exactly_and_its_tensors_map_the_file(tmp_path):
    want = artifact()
    path = written(tmp_path, want)
    data = path.read_bytes()
    got = session_file.read(path)
    assert_same(got, want)
    got.state.k.add_(1)  # a private mapping: the file keeps its bytes
    path.unlink()  # and the tensors outlive the file
    assert path.exists() is False and torch.equal(got.state.v, want.state.v)
    (tmp_path / "again").write_bytes(data)
    assert_same(session_file.read(tmp_path / "again"), want)


def test_a_file_of_format_1_still_loads(tmp_path):
    want = artifact()
    path = tmp_path / "old.session"
    path.write_bytes(session_artifact.encode(want))
    assert path.read_bytes().startswith(session_artifact.MAGIC)
    assert_same(session_file.read(path), want, narrowed=set())  # the wire's format keeps every dtype
    assert session_file.peek(path) is None  # not sized ahead: it loads as it did


def format_2(art: SessionArtifact) -> bytes:
    """``art`` as a file of format 2, an older server's: format 3's layout with every tensor in its own dtype."""
    tensors, meta = session_artifact.contents(art)
    metadata = {"retopk_check": "0" * 24, "retopk_format": "2", "retopk": json.dumps(meta)}
    return resealed(b"".join(bytes(p) for p in payload_parts(tensors, metadata)))


def test_a_file_of_format_2_still_loads_and_format_3_is_smaller(tmp_path):
    want = artifact()
    (tmp_path / "two").write_bytes(format_2(want))
    assert_same(session_file.read(tmp_path / "two"), want, narrowed=set())
    assert session_file.peek(tmp_path / "two") == (10, SPEC)
    narrowed_bytes = sum(t.numel() * 4 for name, t in tensors_of(want).items() if name in NARROWED)
    assert written(tmp_path).stat().st_size <= (tmp_path / "two").stat().st_size - narrowed_bytes + 8


def test_peek_reads_the_tokens_and_method_from_the_header(tmp_path):
    assert session_file.peek(written(tmp_path)) == (10, SPEC)
    none = dataclasses.replace(artifact(), state=dataclasses.replace(artifact().state, state=None))
    assert session_file.peek(written(tmp_path, none, "none")) == (10, None)
    (tmp_path / "junk").write_bytes(b"\x00" * 100)
    assert session_file.peek(tmp_path / "junk") is None


def flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x01
    return bytes(out)


@pytest.mark.parametrize("parts", [1, 3])
def test_damaged_cut_or_foreign_files_are_refused_naming_why(tmp_path, monkeypatch, parts):
    monkeypatch.setattr(parallel_crc, "MIN_PART", 64)  # 3: the check's pass split over threads (engine/parallel_crc.py)
    monkeypatch.setattr(parallel_crc, "max_parts", lambda: parts)
    data = written(tmp_path).read_bytes()
    assert_same(session_file.read(written(tmp_path, name="whole")), artifact())
    text = data.index(b"quotes")  # in the conversation's text, inside the header
    check = session_file.CHECK
    cases = {
        "a tensor byte": (flipped(data, len(data) - 3), "checksum mismatch"),
        "the conversation": (flipped(data, text), "checksum mismatch"),
        "the header length": (flipped(data, 0), "checksum mismatch"),
        "the checksum's digits": (data[:check + 23] + b"g" + data[check + 24:], "corrupted header (the check)"),
        "the size's digits": (data[:check] + b"1" + data[check + 1:], "truncated"),
        "cut short": (data[:len(data) // 2], "truncated"),
        "cut inside the header": (data[:check + 10], "truncated"),
        "bytes appended": (data + b"\0" * 8, "more than the"),
        "not a session file": (b"\x08" + b"\0" * 200, "not a retopk session file"),
        "empty": (b"", "truncated"),
    }
    for name, (damaged, words) in cases.items():
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(ArtifactError, match=re.escape(words)):
            session_file.read(tmp_path / name)


def resealed(payload: bytes) -> bytes:
    """``payload`` (a safetensors payload starting with the check) with its size and CRC-32 made to match."""
    check = session_file.CHECK
    out = bytearray(payload)
    out[check:check + 24] = b"%016x" % len(out) + b"0" * 8
    out[check + 16:check + 24] = b"%08x" % zlib.crc32(out)
    return bytes(out)


def test_a_future_format_and_broken_tensors_under_a_matching_checksum_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(session_file, "FORMAT", 4)
    future = written(tmp_path, name="future").read_bytes()
    monkeypatch.setattr(session_file, "FORMAT", 3)
    (tmp_path / "future").write_bytes(future)
    with pytest.raises(UnsupportedFormat, match="file format '4' is not supported"):
        session_file.read(tmp_path / "future")

    data = written(tmp_path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header["token_ids"]["shape"] = [11]  # 11 int64 in the bytes of 10: the library's parser refuses it
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    broken = resealed(struct.pack("<Q", len(text)) + text + data[8 + n:])
    (tmp_path / "broken").write_bytes(broken)
    with pytest.raises(ArtifactError, match="the tensors do not parse"):
        session_file.read(tmp_path / "broken")


def test_a_file_over_the_limit_is_refused_before_it_is_read(tmp_path):
    path = written(tmp_path)
    with pytest.raises(ArtifactError, match="exceeds 100 bytes"):
        session_file.read(path, limit=100)


def received(data: bytes, size: int, limit: int | None = None) -> SessionArtifact:
    """``data`` through a Receiver in pieces of ``size`` bytes (ImportSession's chunks)."""
    receiver = session_file.Receiver(limit)
    try:
        for at in range(0, len(data), size):
            receiver.feed(data[at:at + size])
        return receiver.finish()
    finally:
        receiver.close()


def test_a_stream_of_any_version_is_read_as_its_file_is_in_chunks_of_any_size(tmp_path):
    """Receiver, what ImportSession reads: the same artifact, or the same refusal, as ``read`` of the whole file,
    wherever the chunk boundaries fall (inside the 24 digits of the check, just after them, one byte at a time),
    for a file's bytes and an older server's format 1; a stated size over the limit and a byte past the stated
    size are refused as they arrive, before the rest."""
    data = written(tmp_path).read_bytes()
    old = session_artifact.encode(artifact())
    check = session_file.CHECK
    for size in (1, 7, check + 3, check + 16, check + 24, 4096, len(data)):
        assert_same(received(data, size), artifact())
        assert_same(received(old, size), artifact(), narrowed=set())
    cases = {
        "a tensor byte": flipped(data, len(data) - 3),
        "the size's digits": data[:check] + b"1" + data[check + 1:],
        "cut short": data[:len(data) // 2],
        "cut inside the check": data[:check + 10],
        "the checksum's digits": data[:check + 23] + b"g" + data[check + 24:],
    }
    for name, damaged in cases.items():
        (tmp_path / name).write_bytes(damaged)
        with pytest.raises(ArtifactError) as by_file:
            session_file.read(tmp_path / name)
        for size in (1, check + 16, 4096):
            with pytest.raises(ArtifactError) as by_stream:
                received(damaged, size)
            assert str(by_stream.value) == str(by_file.value), (name, size)

    class Counted(session_file.Receiver):
        fed = 0

        def feed(self, piece):
            Counted.fed += 1
            super().feed(piece)

    def pieces(bad: bytes) -> list[bytes]:
        return [bad[at:at + check + 16] for at in range(0, len(bad), check + 16)]

    over = data[:check] + b"%016x" % (1 << 40) + data[check + 16:]
    for bad, words, refused_at in ((pieces(over), "exceeds 1000000 bytes", 1),  # the piece completing the size
                                   ([data, b"\0"], "more bytes than the", 2),  # the piece past it
                                   (pieces(b"\x08" + b"\0" * 200), "not a retopk session artifact", 1),
                                   ([], "not a retopk session artifact", None)):
        receiver, Counted.fed = Counted(limit=1_000_000), 0
        with pytest.raises(ArtifactError, match=re.escape(words)):
            for piece in bad:
                receiver.feed(piece)
            receiver.finish()
        receiver.close()
        assert Counted.fed == (refused_at or 0), words
