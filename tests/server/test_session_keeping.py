"""Sessions outlive a drain (real service code, fake runner): --session-dir writes them (files 0600 in a 0700
directory, within a byte budget, the least recently used deleted first) and a later server loads them in the
background from its start, the most recently used first while they fit without evicting, and each other one on
its first use; --handoff-peer hands them to another server, for their owners (the peer key), and the conversation
continues there as if it had never moved.

The embedded model's restart: tests/server/test_session_transfer_live.py; through nginx with real processes:
tests/deploy/test_nginx_handoff.py.
"""

from __future__ import annotations

import logging
import stat
import time

import pytest

from retopk_client import Client, NotFound
from retopk_server.cli import config_from
from retopk_server.engine.session_store import SessionStore
from retopk_server.service import handoff
from tests.server.fake_runner import BLOCK, FakeRunner, greedy_reference
from tests.server.test_tenancy import KEYS, line

pytestmark = pytest.mark.timeout(60)


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def turn(client: Client, session_id: str, text: str) -> list[int]:
    return list(client.complete(text, session_id=session_id, temperature=0, max_new_tokens=5, ignore_eos=True)
                .token_ids)


def conversation(client: Client, session_id: str, turns: list[str]) -> list[int]:
    """Run the turns; the whole conversation's tokens (the fake's model reads all of them)."""
    context = []
    client.create_session(session_id=session_id)
    for text in turns:
        context += enc(text) + turn(client, session_id, text)
    return context


def listed(client: Client, count: int) -> set[str]:
    """The ids of the open sessions, once there are ``count`` (the background preload's; 30 s at most)."""
    deadline = time.monotonic() + 30
    while len(ids := {s.session_id for s in client.list_sessions()}) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return ids


def saved_pair(fake_server, directory) -> dict[str, list[int]]:
    """alpha's and then beta's 3-turn conversations (beta used last), saved by a drain -> their contexts."""
    first = fake_server(session_dir=str(directory))
    with Client(first.address, timeout=30) as client:
        contexts = {sid: conversation(client, sid, [f"{sid} one", " two", " three"]) for sid in ("alpha", "beta")}
    first.drain(0.0)
    return contexts


def test_sessions_saved_at_a_drain_come_back_after_a_restart(fake_server, tmp_path):
    directory = tmp_path / "sessions"
    contexts = saved_pair(fake_server, directory)
    files = sorted(directory.iterdir())
    assert len(files) == 2 and stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert not any(sid in f.name for f in files for sid in ("alpha", "beta"))  # names tell nothing

    second = fake_server(session_dir=str(directory))  # the restart
    with Client(second.address, timeout=30) as client:
        assert listed(client, 2) == {"alpha", "beta"}  # preloaded in the background, no call needed
        info = client.get_session("alpha")
        assert info.turns == 3 and info.num_tokens == len(contexts["alpha"])
        for sid, context in contexts.items():
            assert turn(client, sid, " four") == greedy_reference(context + enc(" four"), 5, stop_at_eos=False)
        assert list(directory.iterdir()) == []  # each file was taken by its session
        with pytest.raises(NotFound):
            client.get_session("never")


def test_damaged_session_files_are_dropped_and_the_server_stays_healthy(fake_server, tmp_path, caplog):
    """A file in --session-dir corrupted (one payload byte flipped: its checksum no longer matches) or truncated
    is refused when it is loaded, by the preload or a call, and dropped with a warning naming why; the call finds
    no session, and the server goes on serving."""
    directory = tmp_path / "sessions"
    saved_pair(fake_server, directory)
    store = SessionStore(directory, 1 << 30)
    damaged = bytearray(store.path("", "alpha").read_bytes())
    damaged[-10] ^= 0xFF
    store.path("", "alpha").write_bytes(bytes(damaged))
    cut = store.path("", "beta").read_bytes()
    store.path("", "beta").write_bytes(cut[:len(cut) // 2])
    caplog.set_level(logging.WARNING, logger="retopk_server")
    second = fake_server(session_dir=str(directory))
    with Client(second.address, timeout=30) as client:
        for sid in ("alpha", "beta"):
            with pytest.raises(NotFound):
                client.get_session(sid)
        assert client.list_sessions() == [] and list(directory.iterdir()) == []
        fresh = client.complete("fresh", temperature=0, max_new_tokens=5, ignore_eos=True)
        assert list(fresh.token_ids) == greedy_reference(enc("fresh"), 5, stop_at_eos=False)
        assert client.health() == "SERVING"
    dropped = [r.getMessage() for r in caplog.records if "dropped the saved session file" in r.getMessage()]
    assert len(dropped) == 2 and any("checksum mismatch" in m for m in dropped) \
        and any("truncated" in m for m in dropped), dropped


def test_the_preload_stops_before_evicting_and_the_rest_come_back_on_first_use(fake_server, tmp_path):
    directory = tmp_path / "sessions"
    contexts = saved_pair(fake_server, directory)
    one = -(-max(len(c) for c in contexts.values()) // BLOCK)  # the blocks of one session: room for one only
    second = fake_server(FakeRunner(kv_blocks=one + 1), session_dir=str(directory))
    with Client(second.address, timeout=30) as client:
        assert listed(client, 1) == {"beta"}  # the most recently used first; alpha did not fit without evicting
        time.sleep(0.2)
        assert {s.session_id for s in client.list_sessions()} == {"beta"} and len(list(directory.iterdir())) == 1
        # alpha's first use loads it, evicting the idle beta as any new session would
        assert turn(client, "alpha", " four") == greedy_reference(contexts["alpha"] + enc(" four"), 5,
                                                                   stop_at_eos=False)
        assert list(directory.iterdir()) == []


def test_the_preload_keeps_each_key_within_its_session_limit_and_goes_on_for_the_others(fake_server, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(line("alice") + "\n" + line("bob") + "\n")
    directory = tmp_path / "sessions"
    first = fake_server(api_keys_file=str(keys), session_dir=str(directory))
    with Client(first.address, api_key=KEYS["bob"], timeout=30) as bob:
        conversation(bob, "b1", ["one"])
    with Client(first.address, api_key=KEYS["alice"], timeout=30) as alice:
        conversation(alice, "a1", ["one"])
        conversation(alice, "a2", ["two"])  # most recently used: a2, a1 (past her coming limit), b1
    first.drain(0.0)
    assert len(list(directory.iterdir())) == 3

    keys.write_text(line("alice", "max_sessions=1") + "\n" + line("bob") + "\n")
    second = fake_server(api_keys_file=str(keys), session_dir=str(directory))
    with Client(second.address, api_key=KEYS["alice"], timeout=30) as alice, \
            Client(second.address, api_key=KEYS["bob"], timeout=30) as bob:
        assert listed(bob, 1) == {"b1"}  # the preload went on past alice's limit, to bob's session
        time.sleep(0.3)
        assert {s.session_id for s in alice.list_sessions()} == {"a2"}  # her limit: 1
        assert len(list(directory.iterdir())) == 1  # a1 waits on disk for its first use


def test_a_peer_imports_a_handed_over_session_within_its_owners_session_limit(fake_server, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(line("alice", "max_sessions=1") + "\n")
    peer = fake_server(api_keys_file=str(keys), peer_key="replicas-secret")
    draining = fake_server(api_keys_file=str(keys), peer_key="replicas-secret", handoff_peer=peer.address,
                           session_dir=str(tmp_path / "sessions"))
    with Client(peer.address, api_key=KEYS["alice"], timeout=30) as alice:
        conversation(alice, "there", ["Hello"])  # her one session on the peer
    with Client(draining.address, api_key=KEYS["alice"], timeout=30) as alice:
        conversation(alice, "here", ["Hello"])
    draining.drain(0.0)
    with Client(peer.address, api_key=KEYS["alice"], timeout=30) as alice:
        assert {s.session_id for s in alice.list_sessions()} == {"there"}
    assert len(list((tmp_path / "sessions").iterdir())) == 1  # refused by the peer: kept on disk


def test_the_drain_gives_keeping_the_sessions_the_time_their_bytes_need_and_names_what_it_drops(
        fake_server, tmp_path, monkeypatch, caplog):
    server = fake_server()
    with Client(server.address, timeout=30) as client:
        for sid in ("old", "new"):
            conversation(client, sid, ["Hello"])
    store = SessionStore(tmp_path / "sessions", 1 << 30)
    past = time.monotonic() - 1  # no time left of the grace: the work's own time decides
    monkeypatch.setattr(handoff, "KEEP_BYTES_PER_S", 1e-6)  # ages: every session is kept
    assert server._run(handoff.keep_sessions(server.engine, past, None, None, store)) == (0, 2, 0)
    monkeypatch.setattr(handoff, "KEEP_BYTES_PER_S", 1e18)  # no time at all: both dropped, each named
    with caplog.at_level(logging.WARNING, logger="retopk_server"):
        assert server._run(handoff.keep_sessions(server.engine, past, None, None, store)) == (0, 0, 2)
    assert "session anonymous/old lost" in caplog.text and "session anonymous/new lost" in caplog.text


def test_the_session_dir_keeps_the_most_recently_used_within_its_budget(fake_server, tmp_path):
    directory = tmp_path / "sessions"
    first = fake_server(session_dir=str(directory))
    with Client(first.address, timeout=30) as client:
        for sid in ("old", "mid", "new"):  # used in this order
            conversation(client, sid, [f"{sid} one"])
        size = len(client.export_session("new"))
    first.drain(0.0)
    assert len(list(directory.iterdir())) == 3
    second = fake_server(session_dir=str(directory), session_dir_bytes=2 * size + size // 2)  # room for two
    with Client(second.address, timeout=30) as client:
        turn(client, "mid", " again")  # loaded, so its file goes
    second.drain(0.0)  # writes mid again: three files do not fit, the least recently used (old) goes
    third = fake_server(session_dir=str(directory))
    with Client(third.address, timeout=30) as client:
        assert client.get_session("mid").turns == 2 and client.get_session("new").turns == 1
        with pytest.raises(NotFound):
            client.get_session("old")


def test_a_drained_server_hands_its_sessions_to_a_peer_for_their_owners(fake_server, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(line("alice") + "\n" + line("bob") + "\n")
    peer = fake_server(api_keys_file=str(keys), peer_key="replicas-secret")
    draining = fake_server(api_keys_file=str(keys), peer_key="replicas-secret", handoff_peer=peer.address)
    with Client(draining.address, api_key=KEYS["alice"], timeout=30) as alice:
        context = conversation(alice, "chat", ["Hello", " and", " then"])
    with Client(draining.address, api_key=KEYS["bob"], timeout=30) as bob:
        bobs = conversation(bob, "chat", ["Bob here"])  # the same id, another key's session
    draining.drain(0.0)
    with Client(peer.address, api_key=KEYS["alice"], timeout=30) as alice, \
            Client(peer.address, api_key=KEYS["bob"], timeout=30) as bob:
        assert alice.get_session("chat").turns == 3 and bob.get_session("chat").turns == 1
        assert turn(alice, "chat", " four") == greedy_reference(context + enc(" four"), 5, stop_at_eos=False)
        assert turn(bob, "chat", " two") == greedy_reference(bobs + enc(" two"), 5, stop_at_eos=False)


def test_without_the_peer_key_a_keyed_peer_refuses_and_the_session_dir_keeps_them(fake_server, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(line("alice") + "\n")
    peer = fake_server(api_keys_file=str(keys), peer_key="replicas-secret")
    draining = fake_server(api_keys_file=str(keys), peer_key="a-wrong-secret", handoff_peer=peer.address,
                           session_dir=str(tmp_path / "sessions"))
    with Client(draining.address, api_key=KEYS["alice"], timeout=30) as alice:
        conversation(alice, "chat", ["Hello"])
    draining.drain(0.0)
    with Client(peer.address, api_key=KEYS["alice"], timeout=30) as alice:
        with pytest.raises(NotFound):
            alice.get_session("chat")
    assert len(list((tmp_path / "sessions").iterdir())) == 1


def test_the_flags_and_their_environment_variables():
    config = config_from(["--session-dir", "/var/lib/retopk", "--session-dir-bytes", "2GiB",
                          "--handoff-peer", "router:8080"], environ={"RETOPK_PEER_KEY": "s3cret"})
    assert (config.session_dir, config.session_dir_bytes) == ("/var/lib/retopk", 2 << 30)
    assert (config.handoff_peer, config.peer_key) == ("router:8080", "s3cret")


def test_the_handoff_requests_are_the_messages_protobuf_serializes_in_chunks_within_the_bound(monkeypatch):
    """handoff.import_requests frames each chunk by hand (tag, varint length, bytes): each equals the protobuf
    library's serialization of ImportSessionRequest(data=chunk) and parses back to it, the chunks within the bound
    wherever the parts' boundaries fall, and together they are the parts' bytes in order (lengths across the
    varint's 1-, 2- and 3-byte forms)."""
    from retopk_proto.retopk.v1 import retopk_pb2 as pb

    monkeypatch.setattr(handoff, "SESSION_CHUNK_BYTES", 20000)
    parts = (b"head", memoryview(bytes(range(256)) * 200), b"", b"x" * 127, b"y" * 128, memoryview(b"tail"))
    whole = b"".join(bytes(p) for p in parts)
    messages = list(handoff.import_requests(parts))
    got = [pb.ImportSessionRequest.FromString(m) for m in messages]
    assert b"".join(m.data for m in got) == whole
    assert all(0 < len(m.data) <= 20000 and not m.HasField("session_id") for m in got)
    assert [m.SerializeToString() for m in got] == messages
    assert {len(m.data) for m in got} >= {4, 127, 128, 20000}
