"""The session affinity key on the wire and the opt-in transcript replay, against the scripted fake service.

Every rpc that names a session must carry the metadata x-session-id equal to the body's session id (a
router hashes it), CreateSession included (the SDK picks the id itself); calls without a session carry
none. A session opened with replay=True continues in a new session when a turn fails with NOT_FOUND or
UNAVAILABLE, sending the whole conversation there; one without replay raises.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from retopk_client import AsyncClient, Client, RetryPolicy, errors
from retopk_client.types import Usage
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from tests.client.fake_service import FakeServer

FAST = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.02, jitter=0.0)
KEY = "x-session-id"


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


def keys(fake) -> list[tuple[str, str | None]]:
    return [(name, md.get(KEY)) for name, md in fake.service.calls]


def test_session_calls_carry_the_session_id_and_others_none(fake):
    with Client(fake.address, retry=FAST, timeout=30) as client:
        client.model_info()
        client.complete("no session")
        with client.session(method="retopk") as s:
            s.complete("one")
            s.refresh()
        client.create_session(session_id="mine")
    created = fake.service.calls[2]
    sid = s.id
    assert len(sid) == 32 and created[1][KEY] == sid  # chosen by the client, so CreateSession carries it
    assert keys(fake) == [("GetModelInfo", None), ("Generate", None), ("CreateSession", sid), ("Generate", sid),
                          ("GetSession", sid), ("CloseSession", sid), ("CreateSession", "mine")]
    assert [r.session_id for r in fake.service.generate_requests] == ["", sid]


def test_a_prefix_key_travels_as_x_prefix_key_on_sessionless_calls_only(fake):
    """The routing key of a shared prompt start (docs/deploy.md), and the cache salt in the body; usage's cached
    prompt tokens come back typed."""
    with Client(fake.address, retry=FAST, timeout=30) as client:
        done = client.complete("a document", prefix_key="doc-1", cache_salt="s")
        with client.session() as s:
            s.complete("one", prefix_key="doc-1")  # a session routes by its id alone

    async def main():
        async with AsyncClient(fake.address, retry=FAST, timeout=30) as client:
            await client.complete("again", prefix_key="doc-2")

    asyncio.run(main())
    routed = [(name, md.get("x-prefix-key"), md.get(KEY)) for name, md in fake.service.calls if name == "Generate"]
    assert routed == [("Generate", "doc-1", None), ("Generate", None, s.id), ("Generate", "doc-2", None)]
    assert [r.cache_salt for r in fake.service.generate_requests] == ["s", "", ""]
    assert done.usage.cached_prompt_tokens == 0 and done.usage.prompt_tokens == 1
    assert Usage.from_proto(pb.Usage(prompt_tokens=9, cached_prompt_tokens=8)).cached_prompt_tokens == 8


def test_async_session_calls_carry_the_session_id(fake):
    async def main():
        async with AsyncClient(fake.address, retry=FAST, timeout=30) as client:
            await client.complete("no session")
            async with client.session() as s:
                await s.complete("one")
            return s.id

    sid = asyncio.run(main())
    assert keys(fake) == [("Generate", None), ("CreateSession", sid), ("Generate", sid), ("CloseSession", sid)]


def test_cli_sets_the_session_metadata(fake, capsys):
    from retopk_client.cli import main

    assert main(["--address", fake.address, "generate", "--session", "s-9", "hi"]) == 0
    assert keys(fake) == [("Generate", "s-9")]


def test_without_replay_a_lost_session_raises_not_found(fake):
    with Client(fake.address, retry=FAST, timeout=30) as client:
        s = client.session()
        s.complete(messages=[{"role": "user", "content": "one"}])
        fake.service.failures["Generate"] = [grpc.StatusCode.NOT_FOUND]
        with pytest.raises(errors.NotFound):
            s.complete(messages=[{"role": "user", "content": "two"}])


@pytest.mark.parametrize("failure", [[grpc.StatusCode.NOT_FOUND], [grpc.StatusCode.UNAVAILABLE] * FAST.max_attempts])
def test_replay_sends_the_whole_conversation_to_a_new_session(fake, failure):
    with Client(fake.address, retry=FAST, timeout=30) as client:
        s = client.session(replay=True)
        first_id = s.id
        one = s.complete(messages=[{"role": "user", "content": "one"}])
        fake.service.failures["Generate"] = list(failure)
        chunks = list(s.generate(messages=iter([{"role": "user", "content": "two"}])))
        three = s.complete(messages=[{"role": "user", "content": "three"}])
    assert "".join(c.text for c in chunks) == one.text == three.text == "Hello, world"
    assert s.replays == 1 and s.id != first_id
    creates = [md[KEY] for name, md in fake.service.calls if name == "CreateSession"]
    assert creates == [first_id, s.id]
    requests = fake.service.generate_requests
    sent = [(r.session_id, [(m.role, m.content) for m in r.chat.messages]) for r in requests]
    assert sent[0] == (first_id, [("user", "one")])
    assert all(sid == first_id for sid, _ in sent[1:1 + len(failure)])  # the failed attempts
    assert sent[-2:] == [
        (s.id, [("user", "one"), ("assistant", "Hello, world"), ("user", "two")]),  # the replay
        (s.id, [("user", "three")]),  # then on as a normal session
    ]


def test_replay_of_text_prompts_concatenates_prompts_and_completions(fake):
    with Client(fake.address, retry=FAST, timeout=30) as client:
        s = client.session(replay=True)
        s.complete("A: ")
        fake.service.failures["Generate"] = [grpc.StatusCode.NOT_FOUND]
        s.complete(" B: ")
    assert fake.service.generate_requests[-1].text == "A: Hello, world B: "


def test_replay_refuses_a_transcript_of_mixed_inputs(fake):
    with Client(fake.address, retry=FAST, timeout=30) as client:
        s = client.session(replay=True)
        s.complete("text")
        fake.service.failures["Generate"] = [grpc.StatusCode.NOT_FOUND]
        with pytest.raises(errors.NotFound) as info:
            s.complete(token_ids=[1, 2])
    assert "mix" in " ".join(info.value.__notes__) and s.replays == 0


def test_replay_does_not_hide_other_errors(fake):
    with Client(fake.address, retry=FAST, timeout=30) as client:
        s = client.session(replay=True)
        fake.service.failures["Generate"] = [grpc.StatusCode.FAILED_PRECONDITION]
        with pytest.raises(errors.FailedPrecondition):
            s.complete("x")
    assert s.replays == 0 and isinstance(fake.service.generate_requests[0], pb.GenerateRequest)


def test_async_replay_continues_a_lost_session(fake):
    async def main():
        async with AsyncClient(fake.address, retry=FAST, timeout=30) as client:
            async with client.session(replay=True) as s:
                first_id = s.id
                await s.complete(messages=[{"role": "user", "content": "one"}])
                fake.service.failures["Generate"] = [grpc.StatusCode.NOT_FOUND]
                texts = [c.text async for c in s.generate(messages=[{"role": "user", "content": "two"}])]
            return first_id, s, texts

    first_id, s, texts = asyncio.run(main())
    assert "".join(texts) == "Hello, world" and s.replays == 1 and s.id != first_id
    last = fake.service.generate_requests[-1]
    assert last.session_id == s.id
    assert [(m.role, m.content) for m in last.chat.messages] == [
        ("user", "one"), ("assistant", "Hello, world"), ("user", "two")]
