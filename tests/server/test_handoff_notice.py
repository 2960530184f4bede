"""A lingering drain (--handoff-linger-s) tells a moved session's owner where it went, and the SDK follows.

Two real gRPC servers in-process (the service code, a fake runner): A, with --handoff-peer B, is drained while it
still listens; a call on a session it handed over gets UNAVAILABLE with the trailer x-retopk-handoff naming B, for
the session's owner only. The SDK, configured with B among its handoff addresses, moves there and the turn goes on
in the same session (its 4th turn, the greedy tokens of the never-moved conversation: nothing replayed); one not
configured so raises the notice instead. The embedded model between two processes:
tests/server/test_session_transfer_live.py.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from retopk_client import AsyncClient, Client, NotFound, RetryPolicy, Unavailable
from retopk_client.channel import ClientConfig
from retopk_client.errors import HANDOFF_METADATA
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.cli import config_from
from retopk_shared.service_names import SERVICE_NAME
from tests.server.fake_runner import FakeRunner, greedy_reference
from tests.server.test_session_keeping import conversation, enc, turn
from tests.server.test_tenancy import KEYS, auth, line

pytestmark = pytest.mark.timeout(90)

LINGER_S = 8.0


def drain_in_background(server, grace_s: float = 0.0) -> threading.Thread:
    thread = threading.Thread(target=server.drain, args=(grace_s,), daemon=True)
    thread.start()
    return thread


def notice(stub, who: str, session_id: str, timeout: float = 20.0) -> tuple[grpc.StatusCode, str | None]:
    """GetSession on the draining server as ``who``, once the handoff is done (its answer no longer OK) -> (code,
    the notice's address or None)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stub.GetSession(pb.GetSessionRequest(session_id=session_id), metadata=auth(who, session_id), timeout=5)
        except grpc.RpcError as e:
            trailer = [v for k, v in (e.trailing_metadata() or ()) if k == HANDOFF_METADATA]
            return e.code(), (trailer[0] if trailer else None)
        assert time.monotonic() < deadline, "the session never moved"
        time.sleep(0.05)


@pytest.fixture
def pair(fake_server, tmp_path):
    """(A, B): A hands over to B and lingers; both with alice's, bob's and carol's keys."""
    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(line(name) for name in KEYS) + "\n")
    peer = fake_server(api_keys_file=str(keys), peer_key="replicas-secret")
    draining = fake_server(FakeRunner(step_delay_s=0.02), api_keys_file=str(keys), peer_key="replicas-secret",
                           handoff_peer=peer.address, handoff_linger_s=LINGER_S)
    return draining, peer


def test_the_owner_gets_the_notice_and_the_sdk_continues_the_same_session_there(pair):
    a, b = pair
    with Client(a.address, api_key=KEYS["alice"], timeout=30) as alice:
        context = conversation(alice, "chat", ["Hello", " and", " then"])
    with Client(a.address, api_key=KEYS["bob"], timeout=30) as bob:
        conversation(bob, "bobs", ["Bob here"])
    drainer = drain_in_background(a)

    assert notice(a.stub, "alice", "chat") == (grpc.StatusCode.UNAVAILABLE, b.address)
    assert notice(a.stub, "carol", "chat") == (grpc.StatusCode.NOT_FOUND, None)  # not hers: as an unknown id
    assert notice(a.stub, "alice", "bobs") == (grpc.StatusCode.NOT_FOUND, None)

    once = RetryPolicy(max_attempts=1)
    with Client(a.address, api_key=KEYS["alice"], timeout=30, retry=once) as stays:  # B is not among its addresses
        with pytest.raises(Unavailable) as refused:
            stays.get_session("chat")
        assert refused.value.handoff == b.address and stays.config.address == a.address
    with Client(a.address, api_key=KEYS["alice"], timeout=30, handoff_addresses=[b.address]) as alice:
        fourth = turn(alice, "chat", " four")  # Generate on A: the notice, then the same session on B
        assert alice.config.address == b.address
        assert fourth == greedy_reference(context + enc(" four"), 5, stop_at_eos=False)
        info = alice.get_session("chat")
        assert info.turns == 4 and info.num_tokens == len(context) + len(enc(" four")) + 5  # continued, not replayed
    with Client(a.address, api_key=KEYS["bob"], timeout=30, follow_any_handoff=True) as bob:
        assert bob.get_session("bobs").turns == 1 and bob.config.address == b.address
    drainer.join(LINGER_S + 30)
    assert not drainer.is_alive()


def test_a_stream_cut_at_the_grace_moves_with_what_it_sent_and_the_async_sdk_follows(pair):
    a, b = pair
    with Client(a.address, api_key=KEYS["alice"], timeout=60) as alice:
        alice.create_session(session_id="long")
        stream = alice.generate("Go on", session_id="long", temperature=0, max_new_tokens=2000, ignore_eos=True)
        sent = [next(stream).token_ids[0]]  # under way
        drainer = drain_in_background(a)
        with pytest.raises(Unavailable):
            for chunk in stream:
                sent += chunk.token_ids
    assert notice(a.stub, "alice", "long")[1] == b.address

    async def next_turn():
        async with AsyncClient(a.address, api_key=KEYS["alice"], timeout=30, handoff_addresses=(b.address,)) as c:
            tokens = (await c.complete(" more", session_id="long", temperature=0, max_new_tokens=5,
                                       ignore_eos=True)).token_ids
            return list(tokens), c.config.address

    tokens, address = asyncio.run(next_turn())
    assert address == b.address
    assert tokens == greedy_reference(enc("Go on") + sent + enc(" more"), 5, stop_at_eos=False)
    drainer.join(LINGER_S + 30)


def test_a_call_before_its_sessions_handoff_waits_for_it_and_gets_the_notice(pair):
    a, b = pair
    with Client(a.address, api_key=KEYS["alice"], timeout=30) as alice:
        context = conversation(alice, "chat", ["Hello", " and", " then"])
        alice.create_session(session_id="long")
        stream = alice.generate("Go on", session_id="long", temperature=0, max_new_tokens=2000, ignore_eos=True)
        next(stream)  # under way: the drain waits its grace for it before handing anything over
        drainer = drain_in_background(a, grace_s=1.0)
        while alice.health(SERVICE_NAME) == "SERVING":  # readiness: the drain has begun
            time.sleep(0.02)
        once = RetryPolicy(max_attempts=1)  # no blind retry: only the notice can bring the call to B
        with Client(a.address, api_key=KEYS["alice"], timeout=30, retry=once, handoff_addresses=[b.address]) as held:
            started = time.monotonic()
            fourth = turn(held, "chat", " four")  # sent during the grace, answered once "chat" has moved
            assert held.config.address == b.address and time.monotonic() - started >= 0.5
        assert fourth == greedy_reference(context + enc(" four"), 5, stop_at_eos=False)
        with pytest.raises(Unavailable):
            list(stream)
    with Client(a.address, api_key=KEYS["carol"], timeout=30, retry=RetryPolicy(max_attempts=1)) as carol:
        with pytest.raises(NotFound):  # not hers: no wait, no notice, as an unknown id
            carol.get_session("chat")
    drainer.join(LINGER_S + 30)


def test_an_http_call_on_a_moved_session_gets_a_503_naming_its_new_home(fake_server, tmp_path):
    import httpx

    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(line(name) for name in KEYS) + "\n")
    b = fake_server(api_keys_file=str(keys), peer_key="replicas-secret")
    a = fake_server(api_keys_file=str(keys), peer_key="replicas-secret", handoff_peer=b.address,
                    handoff_linger_s=LINGER_S, http_port=0)
    with Client(a.address, api_key=KEYS["alice"], timeout=30) as alice:
        conversation(alice, "chat", ["Hello"])
        model = alice.model_info().name
    drainer = drain_in_background(a)
    assert notice(a.stub, "alice", "chat")[1] == b.address  # moved; A still listens, both fronts

    def completion(who: str, **retopk) -> httpx.Response:
        body = {"model": model, "prompt": " more", "max_tokens": 2, "retopk": retopk}
        return httpx.post(a.running.http.url + "/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEYS[who]}"})

    moved = completion("alice", session_id="chat")
    assert moved.status_code == 503 and moved.json()["error"]["code"] == "unavailable"
    assert moved.headers["x-retopk-handoff"] == b.address and moved.headers["retry-after"] == "0"
    draining = completion("alice")  # no session: the drain's plain 503, retried elsewhere a second later
    assert draining.status_code == 503 and draining.headers["retry-after"] == "1"
    assert "x-retopk-handoff" not in draining.headers
    for foreign in (completion("carol", session_id="chat"), completion("alice", session_id="never")):
        assert foreign.status_code == 503 and foreign.headers["retry-after"] == "1"  # not hers: as an unknown id
        assert "x-retopk-handoff" not in foreign.headers
    drainer.join(LINGER_S + 30)


def test_without_linger_the_drain_stops_listening_first_and_gives_no_notice(fake_server):
    peer = fake_server()
    a = fake_server(handoff_peer=peer.address)
    with Client(a.address, timeout=30) as client:
        conversation(client, "chat", ["Hello"])
    a.drain(0.0)
    with Client(a.address, timeout=5, retry=RetryPolicy(max_attempts=1), handoff_addresses=[peer.address]) as client:
        with pytest.raises(Unavailable) as gone:  # nothing listens: the connection is refused, no notice
            client.get_session("chat")
        assert gone.value.handoff is None
    with Client(peer.address, timeout=30) as client:
        assert client.get_session("chat").turns == 1
        with pytest.raises(NotFound):
            client.get_session("never")


def test_the_client_follows_only_what_it_may():
    def err(code, handoff):
        e = Unavailable("moved") if code is grpc.StatusCode.UNAVAILABLE else NotFound("gone")
        e.handoff = handoff
        return e

    listed = ClientConfig(address="a:1", handoff_addresses=("b:2",))
    assert listed.handoff_target(err(grpc.StatusCode.UNAVAILABLE, "b:2")) == "b:2"
    assert listed.handoff_target(err(grpc.StatusCode.NOT_FOUND, "b:2")) == "b:2"
    assert listed.handoff_target(err(grpc.StatusCode.UNAVAILABLE, "evil:6")) is None  # not configured
    assert listed.handoff_target(err(grpc.StatusCode.UNAVAILABLE, None)) is None
    assert listed.handoff_target(err(grpc.StatusCode.UNAVAILABLE, "a:1")) is None  # where it is already
    anywhere = ClientConfig(address="a:1", follow_any_handoff=True)
    assert anywhere.handoff_target(err(grpc.StatusCode.UNAVAILABLE, "evil:6")) == "evil:6"
    with pytest.raises(ValueError, match="handoff_addresses"):
        ClientConfig(address="a:1", handoff_addresses="b:2")


def test_the_flags(capsys):
    config = config_from(["--handoff-peer", "replica-b:50051", "--handoff-linger-s", "15"],
                         environ={"RETOPK_HANDOFF_ADDRESS": "b.example:50051"})
    assert (config.handoff_linger_s, config.handoff_address) == (15.0, "b.example:50051")
    for argv, words in ((["--handoff-linger-s", "15"], "need handoff_peer"),
                        (["--handoff-peer", "b:1", "--handoff-linger-s", "-1"], "handoff_linger_s")):
        with pytest.raises(SystemExit):
            config_from(argv, environ={})
        assert words in capsys.readouterr().err
