"""The engine's scheduler driven by a fake runner (no model): batching, queueing, cancellation,
deadlines, sessions across turns, stop conditions, draining, observer hooks.

Expected tokens come from ``fake_runner.greedy_reference``, the fake model's definition applied
one request at a time, so every batched result is compared against the same request run alone.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from retopk_server.engine import (
    Engine,
    EngineConfig,
    EngineError,
    EngineObserver,
    ErrorCode,
    FinishReason,
    GenerationRequest,
    RequestStream,
)
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling import SamplingParams
from tests.server.fake_runner import EOS, FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


def make_engine(runner: FakeRunner | None = None, observer=None, **limits) -> tuple[Engine, FakeRunner]:
    runner = runner or FakeRunner()
    engine = Engine(lambda: runner, EngineConfig(**limits), observer)
    engine.start()
    return engine, runner


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


async def collect(stream: RequestStream):
    """(events, error): every event until the end, and the EngineError that ended it (or None)."""
    events = []
    try:
        async for event in stream:
            events.append(event)
    except EngineError as e:
        return events, e
    return events, None


async def generate(engine: Engine, **fields):
    stream = RequestStream()
    engine.submit(GenerationRequest(request_id=fields.pop("request_id", "r"), **fields), stream)
    return await collect(stream)


def tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


@pytest.fixture
def engine_runner():
    engine, runner = make_engine()
    yield engine, runner
    engine.stop()


def test_single_request_matches_reference_and_reports_usage(engine_runner):
    engine, runner = engine_runner
    events, error = asyncio.run(generate(engine, text="hello", max_new_tokens=6))
    assert error is None
    expected = greedy_reference(enc("hello"), 6)
    assert tokens(events) == expected
    assert "".join(e.text for e in events) == "".join(map(chr, expected))
    last = events[-1]
    assert last.finish_reason is FinishReason.LENGTH and all(e.finish_reason is None for e in events[:-1])
    assert (last.usage.prompt_tokens, last.usage.generated_tokens) == (5, 6)
    assert last.timings.total_s >= last.timings.time_to_first_token_s >= last.timings.queue_s >= 0
    assert runner.sessions == {}  # the ephemeral session was closed
    assert runner.threads == {"retopk-engine"}  # only the engine thread touched the runner


def test_eos_stops_and_is_not_in_text(engine_runner):
    engine, _ = engine_runner
    events, error = asyncio.run(generate(engine, text="ab.", max_new_tokens=5))
    assert error is None and tokens(events) == [EOS]
    assert events[-1].finish_reason is FinishReason.EOS_TOKEN and events[-1].text == ""
    events, _ = asyncio.run(generate(engine, text="ab.", max_new_tokens=3, ignore_eos=True))
    assert tokens(events) == greedy_reference(enc("ab."), 3, stop_at_eos=False)
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_stop_token_and_stop_string(engine_runner):
    engine, _ = engine_runner
    ref = greedy_reference(enc("xyz"), 8)
    events, _ = asyncio.run(generate(engine, text="xyz", max_new_tokens=8, stop_token_ids=[ref[2]]))
    assert tokens(events) == ref[:3] and events[-1].finish_reason is FinishReason.STOP_TOKEN
    stop = chr(ref[3]) + chr(ref[4])
    events, _ = asyncio.run(generate(engine, text="xyz", max_new_tokens=8, stop=[stop]))
    text = "".join(map(chr, ref))
    assert events[-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert "".join(e.text for e in events) == text[:text.find(stop)]


def test_concurrent_requests_are_batched_and_each_equals_the_request_alone():
    engine, runner = make_engine(FakeRunner(step_delay_s=0.002), max_running=8)
    prompts = [f"prompt number {i} " * (i + 1) for i in range(10)]

    async def main():
        return await asyncio.gather(*(generate(engine, text=p, max_new_tokens=12 + i, request_id=str(i))
                                      for i, p in enumerate(prompts)))

    try:
        results = asyncio.run(main())
    finally:
        engine.stop()
    for i, (events, error) in enumerate(results):
        assert error is None
        assert tokens(events) == greedy_reference(enc(prompts[i]), 12 + i)
    assert max(runner.batch_sizes) == 8  # batch capped at max_running, and actually filled
    assert runner.sessions == {}


def test_queue_full_is_resource_exhausted():
    engine, _ = make_engine(FakeRunner(step_delay_s=0.01), max_running=1, max_queue=1)

    async def main():
        first = RequestStream()
        engine.submit(GenerationRequest("a", text="a", max_new_tokens=200), first)
        await first.__anext__()  # admitted and running
        engine.submit(GenerationRequest("b", text="b", max_new_tokens=2), RequestStream())  # waits in the queue
        with pytest.raises(EngineError) as info:
            engine.submit(GenerationRequest("c", text="c", max_new_tokens=2), RequestStream())
        first.cancel()
        return info.value

    try:
        error = asyncio.run(main())
    finally:
        engine.stop()
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED and "queue" in error.message


def test_cancel_mid_stream_frees_the_slot():
    engine, runner = make_engine(FakeRunner(step_delay_s=0.01), max_running=1)

    async def main():
        stream = RequestStream()
        engine.submit(GenerationRequest("a", text="a", max_new_tokens=2000), stream)
        for _ in range(3):
            await stream.__anext__()
        stream.cancel()
        events, error = await collect(stream)
        # the slot is free: a new request runs to completion
        after = await generate(engine, text="next", max_new_tokens=3)
        return error, after

    try:
        error, (events, after_error) = asyncio.run(main())
        status = engine.commands.status().result()
    finally:
        engine.stop()
    assert error.code is ErrorCode.CANCELLED
    assert after_error is None and tokens(events) == greedy_reference(enc("next"), 3)
    assert runner.sessions == {} and status.running == 0 and status.ephemeral_sessions == 0


def test_deadline_drops_running_and_queued_requests():
    engine, runner = make_engine(FakeRunner(step_delay_s=0.01), max_running=1)

    async def main():
        deadline = time.monotonic() + 0.2
        return await asyncio.gather(
            generate(engine, text="a", max_new_tokens=2000, deadline=deadline),
            generate(engine, text="b", max_new_tokens=2000, deadline=deadline))

    try:
        (_, e1), (_, e2) = asyncio.run(main())
    finally:
        engine.stop()
    assert e1.code is ErrorCode.DEADLINE_EXCEEDED and e2.code is ErrorCode.DEADLINE_EXCEEDED
    assert runner.sessions == {}


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
        with pytest.raises(EngineError) as bad:
            make_engine(runner, max_sessions=5)[0].commands.create_session("d", MethodSpec.of("nope")).result()
    finally:
        engine.stop()
    assert dup.value.code is ErrorCode.ALREADY_EXISTS
    assert full.value.code is ErrorCode.RESOURCE_EXHAUSTED
    assert bad.value.code is ErrorCode.INVALID_ARGUMENT and "method" in bad.value.message


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


@pytest.mark.parametrize("fields, needle", [
    (dict(text="x" * 5000), "text: too long"),
    (dict(token_ids=[1, 200]), "token_ids"),
    (dict(chat=[{"role": "robot", "content": "x"}]), "chat"),
    (dict(text="a", method=MethodSpec.of("retopk", top_k=0)), "method: top_k"),
    (dict(text="a", max_new_tokens=0), "max_new_tokens"),
])
def test_bad_requests_are_invalid_argument_and_leak_nothing(engine_runner, fields, needle):
    engine, runner = engine_runner

    async def main():
        try:
            return await generate(engine, **fields)
        except EngineError as e:  # refused at submission
            return [], e

    events, error = asyncio.run(main())
    assert events == [] and error.code is ErrorCode.INVALID_ARGUMENT and needle in error.message
    assert runner.sessions == {}


def test_context_length_finishes_the_request():
    engine, _ = make_engine(FakeRunner(max_context=20))
    try:
        events, error = asyncio.run(generate(engine, text="x" * 15, max_new_tokens=100))
    finally:
        engine.stop()
    assert error is None and events[-1].finish_reason is FinishReason.CONTEXT_LENGTH
    assert len(tokens(events)) == 6  # positions 15..19 filled by fed tokens, plus the last unfed one


def test_drain_refuses_new_work_and_finishes_running_work():
    engine, _ = make_engine(FakeRunner(step_delay_s=0.005))

    async def main():
        stream = RequestStream()
        engine.submit(GenerationRequest("a", text="a", max_new_tokens=20), stream)
        engine.start_drain()
        with pytest.raises(EngineError) as refused:
            engine.submit(GenerationRequest("b", text="b"), RequestStream())
        return refused.value, await collect(stream)

    try:
        refused, (events, error) = asyncio.run(main())
        assert engine.in_flight() == 0
    finally:
        engine.stop()
    assert refused.code is ErrorCode.UNAVAILABLE
    assert error is None and tokens(events) == greedy_reference(enc("a"), 20)


@pytest.mark.parametrize("max_new", [1, 3])  # 1: the request ends while being admitted (prefill emits it)
def test_a_request_stops_counting_as_in_flight_once_its_last_event_is_out(max_new):
    # The engine thread drops a finished request from its batch only after the step; hold it in
    # the on_finish hook (after the last event) so the drain loop's view of that window is tested.
    release = threading.Event()

    class HoldAtFinish(EngineObserver):
        def on_finish(self, *args):
            release.wait(5)

    engine, _ = make_engine(FakeRunner(), observer=HoldAtFinish())

    async def main():
        stream = RequestStream()
        engine.submit(GenerationRequest("a", text="a", max_new_tokens=max_new), stream)
        events, error = await collect(stream)
        return engine.in_flight(), events, error

    try:
        in_flight, events, error = asyncio.run(main())
    finally:
        release.set()
        engine.stop()
    assert error is None and len(tokens(events)) == max_new
    assert in_flight == 0


def test_stop_fails_running_requests_with_unavailable():
    engine, runner = make_engine(FakeRunner(step_delay_s=0.01))

    async def main():
        stream = RequestStream()
        engine.submit(GenerationRequest("a", text="a", max_new_tokens=2000), stream)
        await stream.__anext__()
        engine.stop()
        return await collect(stream)

    _, error = asyncio.run(main())
    assert error.code is ErrorCode.UNAVAILABLE and runner.sessions == {}


class RecordingObserver(EngineObserver):
    wants_step_stats = True

    def __init__(self):
        self.calls: dict[str, list] = {}

    def __getattribute__(self, name):
        if name.startswith("on_"):
            return lambda *args: self.calls.setdefault(name, []).append(args)
        return object.__getattribute__(self, name)


def test_observer_hooks_and_step_stats():
    observer = RecordingObserver()
    engine, _ = make_engine(observer=observer)
    try:
        events, _ = asyncio.run(generate(engine, text="abc", max_new_tokens=4, return_step_stats=True))
    finally:
        engine.stop()
    calls = observer.calls
    assert len(calls["on_token"]) == 4 and len(calls["on_first_token"]) == 1 and len(calls["on_prefill"]) == 1
    assert len(calls["on_step"]) == 3 and all(len(stats) == 1 for _, _, stats in calls["on_step"])
    assert calls["on_finish"][0][1] == "LENGTH"
    assert calls["on_session_opened"][0][1] is True and calls["on_session_closed"][0][1] is True
    # the first token comes from prefill (no step stats), the other three from decode steps
    assert events[0].step_stats is None and all(e.step_stats is not None for e in events[1:])


def test_seeded_sampling_is_reproducible(engine_runner):
    engine, _ = engine_runner
    # temperature 5 flattens the fake model's one-hot logits: the argmax keeps only ~5% of the mass
    params = SamplingParams(temperature=5.0, seed=1234)
    a, _ = asyncio.run(generate(engine, text="abc", max_new_tokens=8, sampling=params, ignore_eos=True))
    b, _ = asyncio.run(generate(engine, text="abc", max_new_tokens=8, sampling=params, ignore_eos=True))
    c, _ = asyncio.run(generate(engine, text="abc", max_new_tokens=8, ignore_eos=True,
                                sampling=SamplingParams(temperature=5.0, seed=99)))
    assert tokens(a) == tokens(b) and tokens(a) != tokens(c)
