"""ExportSession / ImportSession over gRPC with the real service code and the fake runner (fast): a session moves
between two servers and continues as the conversation never moved would; every malformed, foreign or mismatched
artifact is refused with its status and the server goes on serving.

The keys, values and method state of a real model move in tests/server/runtime/test_runtime_session_state.py
and tests/server/test_session_transfer_live.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from types import SimpleNamespace

import grpc
import pytest

from retopk_client import Client, FailedPrecondition, InvalidArgument, NotFound
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.engine import session_artifact, session_file
from retopk_server.engine.session_artifact import MAGIC, chunks
from retopk_server.runtime.method_spec import MethodSpec
from tests.server.fake_runner import FakeRunner, greedy_reference
from tests.server.test_tenancy import KEYS, line

pytestmark = pytest.mark.timeout(60)

TURNS = ["Hello there", " and then", " what next"]


def greedy_turns(client: Client, session_id: str, turns: list[str]) -> list[list[int]]:
    return [list(client.complete(t, session_id=session_id, temperature=0, max_new_tokens=6).token_ids)
            for t in turns]


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_a_session_moves_to_another_server_and_continues_as_if_never_moved(fake_server):
    a, b = fake_server(), fake_server()
    with Client(a.address, timeout=30) as ca, Client(b.address, timeout=30) as cb:
        ca.create_session(session_id="moving")
        ca.create_session(session_id="staying")  # the reference: the same conversation, never moved
        for sid in ("moving", "staying"):
            greedy_turns(ca, sid, TURNS)
        before = ca.get_session("moving")
        artifact = ca.export_session("moving", close=True)
        with pytest.raises(NotFound):
            ca.get_session("moving")
        info = cb.import_session(artifact)
        assert (info.session_id, info.num_tokens, info.turns) == ("moving", before.num_tokens, 3)
        assert info.method == before.method
        [moved] = greedy_turns(cb, "moving", [" and last"])
        [stayed] = greedy_turns(ca, "staying", [" and last"])
        assert moved == stayed
        assert cb.get_session("moving").turns == 4


def test_reference_of_the_fake_conversation(fake_server):
    """The moved session's 4th turn equals the fake model's definition applied to the whole conversation."""
    a, b = fake_server(), fake_server()
    with Client(a.address, timeout=30) as ca, Client(b.address, timeout=30) as cb:
        ca.create_session(session_id="s")
        outs = greedy_turns(ca, "s", TURNS)
        cb.import_session(ca.export_session("s"), session_id="renamed")
        [fourth] = greedy_turns(cb, "renamed", [" and last"])
    context = []
    for text, out in zip(TURNS, outs, strict=True):
        context += enc(text) + out
    assert fourth == greedy_reference(context + enc(" and last"), 6)


@pytest.fixture
def pair(fake_server, tmp_path):
    """Two servers with the keys alice and bob; alice's 2-turn session "s" on the first and its artifact."""
    path = tmp_path / "keys.txt"
    path.write_text(line("alice") + "\n" + line("bob") + "\n")
    a = fake_server(api_keys_file=str(path))
    b = fake_server(api_keys_file=str(path))
    alice = Client(a.address, api_key=KEYS["alice"], timeout=30)
    alice.create_session(session_id="s")
    greedy_turns(alice, "s", TURNS[:2])
    yield a, b, alice.export_session("s"), path
    alice.close()


def import_status(server, data: bytes, key: str = "alice", chunks=None) -> tuple[grpc.StatusCode, str]:
    requests = chunks if chunks is not None else [pb.ImportSessionRequest(data=data[i:i + (1 << 20)])
                                                  for i in range(0, len(data), 1 << 20)]
    try:
        server.stub.ImportSession(iter(requests), metadata=(("authorization", f"Bearer {KEYS[key]}"),), timeout=30)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def with_header(data: bytes, **changes) -> bytes:
    """The format-1 artifact with its header line's fields changed (the payload as it is)."""
    end = data.index(b"\n", len(MAGIC))
    header = json.loads(data[len(MAGIC):end]) | changes
    return MAGIC + json.dumps(header).encode() + data[end:]


def resealed(data: bytes, payload: bytes) -> bytes:
    """The format-1 artifact with another payload, its size and checksum in the header made to match (the damage
    only the safetensors parser sees)."""
    return with_header(data[:data.index(b"\n", len(MAGIC)) + 1] + payload, payload_bytes=len(payload),
                       payload_sha256=hashlib.sha256(payload).hexdigest())


def with_check(data: bytes, size: int | None = None, crc: int | None = None) -> bytes:
    """The file-format artifact with the size or the CRC-32 its check states replaced."""
    at = session_file.CHECK
    size_digits = data[at:at + 16] if size is None else b"%016x" % size
    crc_digits = data[at + 16:at + 24] if crc is None else b"%08x" % crc
    return data[:at] + size_digits + crc_digits + data[at + 24:]


def test_bad_artifacts_are_refused_with_a_clear_status_and_the_server_stays_healthy(pair, monkeypatch):
    """ExportSession streams a session file's bytes (engine/session_file.py); an older server's format 1 is read
    too. Each is refused when damaged, whatever the damage."""
    a, b, data, _ = pair
    assert not data.startswith(MAGIC)
    old = session_artifact.encode(session_file.decode(data))  # format 1, as an older server exports
    flipped, old_flipped = bytearray(data), bytearray(old)
    flipped[-10] ^= 0xFF
    old_flipped[-10] ^= 0xFF
    monkeypatch.setattr(session_file, "FORMAT", 4)
    future = b"".join(bytes(p) for p in session_file.parts(session_file.decode(data)))
    monkeypatch.undo()
    crc = int(data[session_file.CHECK + 16:session_file.CHECK + 24], 16)
    cases = {
        "truncated": (data[:-100], grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        "cut inside the check": (data[:session_file.CHECK + 5], grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        "corrupted": (bytes(flipped), grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        "wrong checksum": (with_check(data, crc=crc ^ 1), grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        "bytes past the stated size": (data + b"\0", grpc.StatusCode.INVALID_ARGUMENT, "more bytes than"),
        "future format": (future, grpc.StatusCode.FAILED_PRECONDITION, "file format '4'"),
        "stating an oversized artifact": (with_check(data, size=1 << 50), grpc.StatusCode.INVALID_ARGUMENT,
                                          "exceeds"),
        "format 1 truncated": (old[:-100], grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        "format 1 corrupted": (bytes(old_flipped), grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        "format 1 wrong checksum": (with_header(old, payload_sha256=hashlib.sha256(b"x").hexdigest()),
                                    grpc.StatusCode.INVALID_ARGUMENT, "checksum mismatch"),
        "format 1 tensors cut short, checksum resealed": (
            resealed(old, old[old.index(b"\n", len(MAGIC)) + 1:-8]), grpc.StatusCode.INVALID_ARGUMENT,
            "the tensors do not parse"),
        "format 1 future format": (with_header(old, format=2), grpc.StatusCode.FAILED_PRECONDITION, "format 2"),
        "format 1 announcing an oversized payload": (with_header(old, payload_bytes=1 << 50),
                                                     grpc.StatusCode.INVALID_ARGUMENT, "exceeds"),
        "not an artifact": (b"GARBAGE" * 100, grpc.StatusCode.INVALID_ARGUMENT, "not a retopk session artifact"),
        "empty": (b"", grpc.StatusCode.INVALID_ARGUMENT, "not a retopk session artifact"),
        "foreign key": (data, grpc.StatusCode.PERMISSION_DENIED, "another key"),
        "format 1 foreign key": (old, grpc.StatusCode.PERMISSION_DENIED, "another key"),
    }
    for name, (bad, code, words) in cases.items():
        got = import_status(b, bad, key="bob" if "foreign key" in name else "alice")
        assert got[0] == code and words in got[1] and got[1].startswith(("artifact", "data")), (name, got)
    over = import_status(b, b"", chunks=[pb.ImportSessionRequest(data=b"\0" * ((1 << 20) + 1))])
    assert over[0] == grpc.StatusCode.INVALID_ARGUMENT and over[1].startswith("data: a chunk holds at most")
    late_id = import_status(b, b"", chunks=[pb.ImportSessionRequest(data=data[:10]),
                                            pb.ImportSessionRequest(data=data[10:], session_id="x")])
    assert late_id[0] == grpc.StatusCode.INVALID_ARGUMENT and late_id[1].startswith("session_id:")

    with Client(b.address, api_key=KEYS["alice"], timeout=30) as alice_b, \
            Client(b.address, api_key=KEYS["bob"], timeout=30) as bob_b:
        assert alice_b.list_sessions() == [] and bob_b.list_sessions() == []  # nothing half-imported
        info = alice_b.import_session(data)  # the good artifact still goes in, and it is alice's
        assert info.session_id == "s" and info.turns == 2
        with pytest.raises(NotFound):
            bob_b.get_session("s")
        assert import_status(b, data)[0] == grpc.StatusCode.ALREADY_EXISTS
        assert alice_b.import_session(old, session_id="s1").turns == 2  # and so does an older server's export
        # healthy: a new request is served, greedy as the definition says
        out = alice_b.complete("Fine.", temperature=0, max_new_tokens=4)
        assert list(out.token_ids) == greedy_reference(enc("Fine."), 4)
        assert alice_b.health() == "SERVING"


def test_an_export_streams_in_chunks_within_the_bound_without_joining_its_parts():
    """ExportSession's chunks (session_artifact.chunks over session_file.parts): none exceeds the bound, whatever the
    parts' sizes against it, and together they are the artifact's bytes in order."""
    parts = (b"head\n", memoryview(bytes(range(256)) * 3), b"", b"x" * 7, memoryview(b"tail"))
    whole = b"".join(bytes(p) for p in parts)
    for size in (1, 5, 7, 256, 1000, len(whole)):
        pieces = list(chunks(parts, size))
        assert b"".join(pieces) == whole and all(0 < len(c) <= size for c in pieces), size


def test_another_key_cannot_export_a_session(pair):
    a, _, _, _ = pair
    with Client(a.address, api_key=KEYS["bob"], timeout=30) as bob:
        with pytest.raises(NotFound, match="no session 's'"):
            bob.export_session("s")


def test_a_mismatched_model_setup_is_refused_naming_what_differs(fake_server, pair):
    _, _, data, path = pair
    runner = FakeRunner()
    runner.info = dataclasses.replace(runner.info, kv_dtype="bfloat16", name="other")
    other = fake_server(runner, api_keys_file=str(path))
    code, details = import_status(other, data)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "kv_dtype: 'bfloat16' here, 'float32' in the artifact" in details and "name: 'other' here" in details
    with Client(other.address, api_key=KEYS["alice"], timeout=30) as alice:
        assert alice.list_sessions() == []


BLOCKS = "int4, lm_head int8"  # a GGUF model's weight_format (ModelInfo) with float32 activations


@pytest.mark.parametrize("activations", ["float32", "bf16x2", "int16", "int8"])
def test_the_fingerprint_takes_bf16x2_and_int16_activations_as_float32_and_int8_apart(activations):
    """model_fingerprint / check_model on the weight formats the decoder shows (", activations NAME" after the
    weights, nothing for float32): bf16x2's and int16's fingerprints are float32's, so a session moves between the
    three (either way, and from an earlier server that wrote the whole string); int8's is another; what users see
    (ModelInfo.weight_format) keeps the activations."""
    shown = {"float32": BLOCKS, "bf16x2": BLOCKS + ", activations bf16x2", "int16": BLOCKS + ", activations int16",
             "int8": BLOCKS + ", activations int8"}
    info = {a: dataclasses.replace(FakeRunner().info, weight_format=f) for a, f in shown.items()}
    here = info[activations]
    assert here.weight_format == shown[activations]
    fingerprint = session_artifact.model_fingerprint(here)
    assert fingerprint["weight_format"] == (BLOCKS + ", activations int8" if activations == "int8" else BLOCKS)
    for there in shown:
        moved = SimpleNamespace(model=session_artifact.model_fingerprint(info[there]))  # all check_model reads
        written_whole = SimpleNamespace(model=moved.model | {"weight_format": shown[there]})
        for artifact in (moved, written_whole):
            diff = session_artifact.check_model(artifact, here)
            if (activations == "int8") == (there == "int8"):
                assert diff is None, (activations, there)
            else:
                assert diff == (f"weight_format: {fingerprint['weight_format']!r} here, "
                                f"{session_artifact.model_fingerprint(info[there])['weight_format']!r} in the "
                                "artifact"), (activations, there)


@pytest.mark.parametrize("taker", ["bf16x2", "int16"])
def test_a_session_moves_between_float32_and_bf16x2_or_int16_servers_not_to_int8(fake_server, pair, taker):
    """Over gRPC: alice's artifact from a float32 server (weight format ``BLOCKS``) imports into a server showing
    bf16x2 (or int16) activations, whose turn continues as the fake's reference does, and is refused by an int8 one
    naming the weight format."""
    _, _, _, path = pair
    servers = {}
    for activations in ("float32", taker, "int8"):
        runner = FakeRunner()
        shown = BLOCKS + ("" if activations == "float32" else f", activations {activations}")
        runner.info = dataclasses.replace(runner.info, weight_format=shown)
        servers[activations] = fake_server(runner, api_keys_file=str(path))
    with Client(servers["float32"].address, api_key=KEYS["alice"], timeout=30) as alice:
        alice.create_session(session_id="s")
        outs = greedy_turns(alice, "s", TURNS[:2])
        data = alice.export_session("s")
    code, details = import_status(servers["int8"], data)
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"(weight_format: '{BLOCKS}, activations int8' here, '{BLOCKS}' in the artifact)" in details, details
    with Client(servers[taker].address, api_key=KEYS["alice"], timeout=30) as alice:
        assert alice.import_session(data).session_id == "s"
        [third] = greedy_turns(alice, "s", TURNS[2:])
    context = []
    for text, out in zip(TURNS[:2], outs, strict=True):
        context += enc(text) + out
    assert third == greedy_reference(context + enc(TURNS[2]), 6)


def test_a_method_this_server_cannot_run_is_refused_naming_it(pair):
    """The same model, but the session's method config is out of this server's bounds (a top_k past its
    context): FAILED_PRECONDITION naming the method and the field, and nothing is opened."""
    _, b, data, _ = pair
    artifact = session_file.decode(data)
    artifact.state.method = MethodSpec.of("exact_topk", top_k=1 << 30)
    code, details = import_status(b, session_artifact.encode(artifact))
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert details.startswith("artifact.method: this server cannot run") and "top_k" in details, details
    with Client(b.address, api_key=KEYS["alice"], timeout=30) as alice:
        assert alice.list_sessions() == [] and alice.health() == "SERVING"


def test_a_busy_session_is_not_exported_and_the_limits_are_reported(fake_server):
    server = fake_server(FakeRunner(step_delay_s=0.02))
    with Client(server.address, timeout=30) as client:
        client.create_session(session_id="busy")
        with client.generate("Hi", session_id="busy", max_new_tokens=1000, ignore_eos=True) as stream:
            next(stream)  # the request holds the session until its stream ends
            with pytest.raises(FailedPrecondition, match="busy"):
                client.export_session("busy")
        limits = client.model_info().limits
        assert limits.max_session_chunk_bytes == 1 << 20
        assert limits.max_session_artifact_bytes > limits.max_session_chunk_bytes
        with pytest.raises(InvalidArgument, match="session_id"):
            client.export_session("")
        with pytest.raises(NotFound):
            client.export_session("nope")


def test_the_async_client_moves_a_session_too(fake_server):
    import asyncio

    from retopk_client import AsyncClient

    a, b = fake_server(), fake_server()

    async def move() -> tuple:
        async with AsyncClient(a.address, timeout=30) as ca, AsyncClient(b.address, timeout=30) as cb:
            await ca.create_session(session_id="s")
            await ca.complete("Hello", session_id="s", temperature=0, max_new_tokens=4)
            info = await cb.import_session(await ca.export_session("s", close=True), session_id="t")
            reply = await cb.complete(" again", session_id="t", temperature=0, max_new_tokens=4)
            return info, list(reply.token_ids)

    info, tokens = asyncio.run(move())
    first = greedy_reference(enc("Hello"), 4)
    assert info.session_id == "t" and info.num_tokens == 9
    assert tokens == greedy_reference(enc("Hello") + first + enc(" again"), 4)
