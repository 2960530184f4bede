"""A session of the embedded SmolLM2-135M moves between two servers (the real service, engine and runtime,
in-process, each its own runner): three greedy chat turns on A, ExportSession, ImportSession on B, and turn 4
on B equals turn 4 of the same session on A (never moved), for full, Exact Top-K and the default ReTopK; B
holds exactly A's keys, values and FIFOs. Also on the real model: an edited history, and a turn that ends
early (cancelled, expired, client gone) leaving what a turn of the tokens it sent leaves."""

from __future__ import annotations

import time

import pytest
import torch

from retopk_client import Client, DeadlineExceeded
from retopk_server.engine.session_file import decode
from retopk_server.runtime import ModelRunner, RuntimeConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TURNS = ["Name a colour.", "Why that one?", "And a fruit?", "Which is sweeter?"]
# The default ReTopK attends densely below 1,024 tokens (dense_below) and fills its FIFOs in the last C steps
# below; a first message past that makes its FIFOs live (reused, refreshed) before the move. Its first
# refresh_first (8) decode steps of each turn are exact, so a turn of 16 tokens also takes sparse steps after them.
NEW_TOKENS = 16
LONG = "Here is a list of colours: " + ", ".join(["red", "green", "blue", "yellow", "purple"] * 180) + ". "


@pytest.fixture(scope="module")
def runners(embedded_model):
    model, tokenizer = embedded_model
    return [ModelRunner(RuntimeConfig(kv_cache_bytes=512 << 20, kv_block_size=block), model=model,
                        tokenizer=tokenizer) for block in (16, 32)]


def chat_turn(client: Client, session_id: str, text: str) -> list[int]:
    reply = client.complete(messages=[{"role": "user", "content": text}], session_id=session_id, temperature=0,
                            max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return list(reply.token_ids)


@pytest.mark.parametrize("method", ["full", "exact_topk", None])  # None: the server's default ReTopK
def test_turn_four_on_the_new_server_equals_the_never_moved_session(fake_server, runners, method):
    a, b = fake_server(runners[0]), fake_server(runners[1])
    sid = f"chat-{method or 'default'}"
    with Client(a.address, timeout=300) as ca, Client(b.address, timeout=300) as cb:
        ca.create_session(method=method, session_id=sid)
        for i, text in enumerate(TURNS[:3]):
            chat_turn(ca, sid, (LONG if method is None and i == 0 else "") + text)
        exported = ca.export_session(sid)
        info = cb.import_session(exported)
        assert info.num_tokens == ca.get_session(sid).num_tokens and info.turns == 3
        held = decode(cb.export_session(sid)).state  # what B holds, before it runs anything
        sent = decode(exported).state
        for kv in ("k", "v"):  # per position: the two runners' KV blocks differ in size
            assert torch.equal(held.positions(getattr(held, kv)), sent.positions(getattr(sent, kv))), kv
        assert (held.state is None) == (sent.state is None) and (method is None) == bool(sent.state)
        for field, t in (sent.state or {}).items():
            assert torch.equal(held.state[field], t), field
        if method is None:
            assert info.num_tokens > 1024 and int(sent.state["fill"].min()) > 0 and int(sent.state["step"].min()) > 0
        assert chat_turn(cb, sid, TURNS[3]) == chat_turn(ca, sid, TURNS[3])
        ca.close_session(sid)
        cb.close_session(sid)


@pytest.mark.parametrize("method", ["full", None])  # None: the default ReTopK (dense below 1,024 tokens)
def test_an_edited_history_equals_a_fresh_session_fed_it(fake_server, runners, method):
    server = fake_server(runners[0])
    with Client(server.address, timeout=300) as client:
        client.create_session(method=method, session_id="edited")
        history = []
        for text in TURNS[:2]:
            history.append({"role": "user", "content": text})
            reply = client.complete(messages=history[-1:], session_id="edited", temperature=0, max_new_tokens=8)
            history.append({"role": "assistant", "content": reply.text})
        edited = [*history[:2], {"role": "user", "content": "Why not another one?"}]  # the second question edited
        rewound = client.complete(messages=edited, session_id="edited", chat_history=True, temperature=0,
                                  max_new_tokens=8, ignore_eos=True)
        client.create_session(method=method, session_id="fresh")
        fresh = client.complete(messages=edited, session_id="fresh", temperature=0, max_new_tokens=8,
                                ignore_eos=True)
        assert list(rewound.token_ids) == list(fresh.token_ids)
        if method == "full":  # the common prefix was kept, not fed again
            assert rewound.usage.prompt_tokens < fresh.usage.prompt_tokens
        else:  # ReTopK re-observes its last C = 128 queries: a conversation this short is fed again whole
            assert rewound.usage.prompt_tokens == fresh.usage.prompt_tokens
        assert client.get_session("edited").num_tokens == client.get_session("fresh").num_tokens


def test_a_restart_with_a_session_dir_continues_with_identical_greedy_tokens(fake_server, runners, tmp_path,
                                                                           monkeypatch):
    """The drain writes the sessions, a new server (another runner) loads one on its first use: its turn 4 equals
    the turn 4 the same conversation got before the restart, for the default ReTopK with live FIFOs. Before it
    takes calls the new server sized its pools for both saved sessions (their tokens and method, from the files),
    so the load grows none."""
    first = fake_server(runners[0], session_dir=str(tmp_path))
    with Client(first.address, timeout=300) as client:
        for sid in ("kept", "reference"):
            client.create_session(session_id=sid)
            for i, text in enumerate(TURNS[:3]):
                chat_turn(client, sid, (LONG if i == 0 else "") + text)
        expected = chat_turn(client, "reference", TURNS[3])  # never moved
        # the tokens in each cache: num_tokens counts the one sampled last too, which the next turn feeds
        lengths = sorted(client.get_session(sid).num_tokens - 1 for sid in ("kept", "reference"))
    first.drain(0.0)
    sized = []
    monkeypatch.setattr(runners[1], "make_room", lambda sessions: sized.append(sessions) or
                        ModelRunner.make_room(runners[1], sessions))
    second = fake_server(runners[1], session_dir=str(tmp_path))
    spec = runners[1].config.default_method
    assert [sorted(s) for s in sized] == [[(lengths[0], spec), (lengths[1], spec)]]
    pools = runners[1].pool.capacity, runners[1].method_group(spec).states[0].capacity
    with Client(second.address, timeout=300) as client:
        assert client.get_session("kept").turns == 3  # loaded
        assert (runners[1].pool.capacity, runners[1].method_group(spec).states[0].capacity) == pools
        assert chat_turn(client, "kept", TURNS[3]) == expected
        assert client.get_session("kept").turns == 4


def idle_session(client: Client, session_id: str):
    """The session once no request holds it (a cancelled stream ends at the engine's next step)."""
    deadline = time.monotonic() + 60
    while (info := client.get_session(session_id)).busy and time.monotonic() < deadline:
        time.sleep(0.02)
    return info


@pytest.mark.parametrize("how", ["cancelled", "expired", "client gone"])
def test_a_turn_ended_mid_stream_leaves_what_a_turn_of_the_tokens_sent_leaves(fake_server, runners, how):
    """docs/reliability.md's turn integrity on the embedded model and the default ReTopK with live FIFOs (the
    fake runner's tests have no method state): a turn cut after k streamed tokens leaves its input and exactly
    k tokens, so the session equals a never-cut one whose turn asked for k tokens: the same KV, FIFOs and step
    counters, and the same next turn."""
    runner = runners[0]
    first = runner.encode(LONG + TURNS[0])[:1100]  # past dense_below: the FIFOs are live before the cut
    second, third = runner.encode(" " + TURNS[1], False), runner.encode(" " + TURNS[2], False)
    server = fake_server(runner)
    opts = dict(temperature=0, ignore_eos=True)
    with Client(server.address, timeout=300) as client:
        for sid in ("cut", "ref"):
            client.create_session(session_id=sid)
            client.complete(token_ids=first, session_id=sid, max_new_tokens=4, **opts)
        before = client.get_session("ref").num_tokens
        received: list[int] = []
        other = Client(server.address, timeout=300)
        stream_opts = dict(token_ids=second, session_id="cut", max_new_tokens=400, **opts)
        if how == "expired":
            with pytest.raises(DeadlineExceeded):
                for chunk in other.generate(timeout=2.0, **stream_opts):
                    received += chunk.token_ids
        else:
            stream = other.generate(**stream_opts)
            for chunk in stream:
                received += chunk.token_ids
                if len(received) >= 3:
                    break
            stream.cancel() if how == "cancelled" else other.close()  # gone: its channel closes mid-stream
        other.close()
        kept = idle_session(client, "cut").num_tokens - before - len(second)
        assert kept >= len(received) >= 1, (kept, received)
        sent = list(client.complete(token_ids=second, session_id="ref", max_new_tokens=kept, **opts).token_ids)
        assert received == sent[:len(received)]
        cut, ref = (decode(client.export_session(sid)).state for sid in ("cut", "ref"))
        for kv in ("k", "v"):
            assert torch.equal(cut.positions(getattr(cut, kv)), ref.positions(getattr(ref, kv))), kv
        assert int(ref.state["fill"].min()) > 0 and ref.state.keys() == cut.state.keys()
        for field, t in ref.state.items():
            assert torch.equal(cut.state[field], t), field
        nxt = [list(client.complete(token_ids=third, session_id=sid, max_new_tokens=6, **opts).token_ids)
               for sid in ("cut", "ref")]
        assert nxt[0] == nxt[1]


@pytest.mark.parametrize("method", ["full", "exact_topk", None])  # None: the server's default ReTopK
def test_a_drained_server_hands_a_live_session_to_its_peer_which_continues_it_as_never_moved(fake_server, runners,
                                                                                              method):
    """Issue 33's two-server acceptance through the drain itself (the tests above move a session by export and
    import): three greedy chat turns on A, A drained with ``handoff_peer`` B, and B holds exactly A's keys,
    values and FIFOs, and its turn 4 equals turn 4 of the same conversation never moved."""
    b = fake_server(runners[1])
    a = fake_server(runners[0], handoff_peer=b.address)
    sid = f"drained-{method or 'default'}"
    texts = [(LONG if method is None else "") + TURNS[0], *TURNS[1:]]
    with Client(a.address, timeout=300) as ca, Client(b.address, timeout=300) as cb:
        for client, name in ((ca, sid), (cb, "never-moved")):
            client.create_session(method=method, session_id=name)
            for text in texts[:3]:
                chat_turn(client, name, text)
        sent = decode(ca.export_session(sid)).state  # what A holds before its drain
        a.drain(0.0)
        assert cb.get_session(sid).turns == 3
        held = decode(cb.export_session(sid)).state
        for kv in ("k", "v"):
            assert torch.equal(held.positions(getattr(held, kv)), sent.positions(getattr(sent, kv))), kv
        assert (method is None) == bool(sent.state) and (held.state or {}).keys() == (sent.state or {}).keys()
        for field, t in (sent.state or {}).items():
            assert torch.equal(held.state[field], t), field
        assert chat_turn(cb, sid, texts[3]) == chat_turn(cb, "never-moved", texts[3])
        for name in (sid, "never-moved"):
            cb.close_session(name)
