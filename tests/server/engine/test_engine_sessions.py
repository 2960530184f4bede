"""The engine's sessions with a fake runner: context across turns, chat feeds, busy and unknown sessions,
limits, idle timeout."""

from __future__ import annotations

import asyncio

import pytest

from retopk_server.engine import EngineError, ErrorCode, GenerationRequest, RequestStream
from retopk_server.runtime.method_spec import MethodSpec
from tests.server.engine.engine_helpers import collect, enc, generate, make_engine, tokens
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


def test_session_keeps_context_across_turns(engine_runner):
    engine, runner = engine_runner
    info = engine.commands.create_session("s1", None).result()
    assert info.session_id == "s1" and info.num_tokens == 0 and info.method == runner.info.default_method
    assert info.method_params["top_k"] == 8 and info.method_params["cache_size"] == 32  # resolved

    e1, _ = asyncio.run(generate(engine, text="one ", session_id="s1", max_new_tokens=4))
    e2, _ = asyncio.run(generate(engine, text="two ", session_id="s1", max_new_tokens=5))
    gen1 = greedy_reference(enc("one "), 4)
    assert tokens(e1) == gen1
    assert tokens(e2) == greedy_reference(enc("one ") + gen1 + enc("two "), 5)
    assert e2[-1].session_id == "s1" and e2[-1].usage.session_tokens == 4 + 4 + 4 + 5
    info = engine.commands.get_session("s1").result()
    assert info.turns == 2 and info.num_tokens == 17 and not info.busy
    assert [s.session_id for s in engine.commands.list_sessions().result()] == ["s1"]
    engine.commands.close_session("s1").result()
    assert runner.sessions == {} and engine.commands.list_sessions().result() == []
    with pytest.raises(EngineError) as err:
        engine.commands.get_session("s1").result()
    assert err.value.code is ErrorCode.NOT_FOUND


def test_chat_session_feeds_only_what_the_cache_lacks(engine_runner):
    engine, runner = engine_runner
    engine.commands.create_session("c", None).result()
    turn1 = [{"role": "user", "content": "hi"}]
    e1, _ = asyncio.run(generate(engine, chat=turn1, session_id="c", max_new_tokens=3))
    reply = "".join(e.text for e in e1)
    turn2 = [{"role": "user", "content": "more"}]
    e2, _ = asyncio.run(generate(engine, chat=turn2, session_id="c", max_new_tokens=3))
    conversation = turn1 + [{"role": "assistant", "content": reply}] + turn2
    full = runner.encode_chat(conversation)
    # The cache holds the conversation as the template renders it, up to the end of the first reply,
    # then only the new part: no token was fed twice.
    seen = runner.sessions["c"].token_ids
    assert seen[:len(full)] == full
    assert tokens(e2) == greedy_reference(seen[:len(full)], 3)


def test_busy_and_unknown_sessions():
    engine, _ = make_engine(FakeRunner(step_delay_s=0.01))

    async def main():
        engine.commands.create_session("s", None).result()
        stream = RequestStream()
        engine.submit(GenerationRequest("a", text="a", session_id="s", max_new_tokens=2000), stream)
        await stream.__anext__()
        with pytest.raises(EngineError) as busy:
            engine.submit(GenerationRequest("b", text="b", session_id="s"), RequestStream())
        with pytest.raises(EngineError) as close_busy:
            engine.commands.close_session("s").result()
        with pytest.raises(EngineError) as unknown:
            engine.submit(GenerationRequest("c", text="c", session_id="nope"), RequestStream())
        stream.cancel()
        await collect(stream)
        return busy.value, close_busy.value, unknown.value

    try:
        busy, close_busy, unknown = asyncio.run(main())
        assert engine.commands.close_session("s").result().turns == 1  # free again after the cancel
    finally:
        engine.stop()
    assert busy.code is ErrorCode.FAILED_PRECONDITION and "busy" in busy.message
    assert close_busy.code is ErrorCode.FAILED_PRECONDITION
    assert unknown.code is ErrorCode.NOT_FOUND and "session_id" in unknown.message


def test_session_limits_and_duplicates():
    engine, runner = make_engine(max_sessions=2)
    try:
        engine.commands.create_session("a", None).result()
        with pytest.raises(EngineError) as dup:
            engine.commands.create_session("a", None).result()
        engine.commands.create_session(None, MethodSpec.of("full")).result()
        with pytest.raises(EngineError) as full:
            engine.commands.create_session("c", None).result()
        with pytest.raises(ValueError, match="nope"):  # the wire checks the method; a bad one here is a bug
            make_engine(runner, max_sessions=5)[0].commands.create_session("d", MethodSpec.of("nope")).result()
    finally:
        engine.stop()
    assert dup.value.code is ErrorCode.ALREADY_EXISTS
    assert full.value.code is ErrorCode.RESOURCE_EXHAUSTED


def test_idle_sessions_are_closed_after_the_timeout_but_busy_ones_are_kept():
    engine, runner = make_engine(FakeRunner(step_delay_s=0.02), session_idle_timeout_s=0.3, idle_wait_s=0.02)

    async def main():
        engine.commands.create_session("idle", None).result()
        engine.commands.create_session("busy", None).result()
        stream = RequestStream()
        engine.submit(GenerationRequest("a", text="a", session_id="busy", max_new_tokens=2000), stream)
        await stream.__anext__()
        await asyncio.sleep(0.8)  # both unused for longer than the timeout; "busy" is still generating
        left = {s.session_id for s in engine.commands.list_sessions().result()}
        stream.cancel()
        await collect(stream)
        return left

    try:
        left = asyncio.run(main())
        assert left == {"busy"} and "idle" not in runner.sessions  # closed in the runner too
        with pytest.raises(EngineError) as gone:
            engine.commands.get_session("idle").result()
        assert engine.commands.get_session("busy").result().turns == 1  # its turn just ended: not idle
    finally:
        engine.stop()
    assert gone.value.code is ErrorCode.NOT_FOUND
