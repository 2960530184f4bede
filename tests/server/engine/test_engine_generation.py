"""The engine's step with a fake runner (no model): tokens equal the request run alone (batched or not), stop
conditions, the context length, seeded sampling, requests refused for their input, observer hooks."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from retopk_server.engine import EngineObserver, ErrorCode, FinishReason
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling import SamplingParams
from tests.server.engine.engine_helpers import enc, generate, make_engine, tokens
from tests.server.fake_runner import EOS, FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


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


@pytest.mark.parametrize("step_tokens", [512, 10])
def test_the_prompts_queued_during_a_step_are_fed_in_one_shared_prefill(step_tokens):
    """Three requests queue while the batch's decode step waits: the next iteration admits all three and feeds
    their prompts in one ``prefill_together`` (with a budget of 10 tokens, the third prompt's rest waits for
    the next iteration, still admitted, and goes with the fourth); each request's tokens equal the request
    alone."""
    gate = threading.Event()
    engine, runner = make_engine(FakeRunner(gate=gate), max_running=8, max_step_tokens=step_tokens)
    prompts = ["first", "second", "third", "fourth"]  # 5, 6, 5 and 6 tokens

    async def main():
        first = asyncio.ensure_future(generate(engine, text=prompts[0], max_new_tokens=4, request_id="0"))
        while ("decode", 1) not in runner.log:  # the first request's decode step waits at the gate
            await asyncio.sleep(0.005)
        rest = [asyncio.ensure_future(generate(engine, text=p, max_new_tokens=4, request_id=str(i)))
                for i, p in enumerate(prompts[1:], start=1)]
        while engine.scheduler.load()[0] < 3:
            await asyncio.sleep(0.005)
        gate.set()
        return await asyncio.gather(first, *rest)

    try:
        results = asyncio.run(main())
    finally:
        gate.set()
        engine.stop()
    for prompt, (events, error) in zip(prompts, results, strict=True):
        assert error is None and tokens(events) == greedy_reference(enc(prompt), 4)
    assert runner.trims > 0  # the engine's idle passes let the runner trim its pools
    shared = [(kind, n) for kind, n in runner.log if kind.startswith("prefill")]
    if step_tokens == 512:
        assert shared[2:] == [("prefill_together", 3), ("prefill", 6), ("prefill", 5), ("prefill", 6)]
    else:  # 10 - 1 running: 6 + 3, then (10 - 2 running) the third's last 2 and the fourth's 6
        assert shared[2:] == [("prefill_together", 2), ("prefill", 6), ("prefill", 3),
                              ("prefill_together", 2), ("prefill", 2), ("prefill", 6)]


@pytest.mark.parametrize("fields, needle", [
    (dict(text="x" * 5000), "text: too long"),
    (dict(chat=[{"role": "robot", "content": "x"}]), "chat"),
])
def test_input_only_the_tokenizer_can_judge_is_invalid_argument_and_leaks_nothing(engine_runner, fields, needle):
    """The engine refuses only what needs the tokenizer or the session (the wire checks the rest: tests/server/
    test_service.py's INVALID list over gRPC, tests/server/http/ over HTTP)."""
    engine, runner = engine_runner
    events, error = asyncio.run(generate(engine, **fields))
    assert events == [] and error.code is ErrorCode.INVALID_ARGUMENT and needle in error.message
    assert runner.sessions == {}


@pytest.mark.parametrize("fields, needle", [
    (dict(text="a", max_new_tokens=0), "max_new_tokens"),
    (dict(text="a", max_new_tokens=10**6), "max_new_tokens"),
    (dict(text="a", n=0), "n"),
    (dict(text="a", n=2, session_id="s"), "n"),
    (dict(text="a", top_logprobs=21, logprobs=True), "top_logprobs"),
    (dict(text="a", top_logprobs=2), "top_logprobs"),
    (dict(text="a", constraint=object()), "constraint"),
])
def test_an_unchecked_request_breaks_an_invariant_not_a_client_refusal(engine_runner, fields, needle):
    """Below the boundary a request the wire would have refused is a caller's bug: an AssertionError at submission
    (INTERNAL over the wire), never an EngineError a client could read as its own fault; nothing is queued."""
    engine, runner = engine_runner
    with pytest.raises(AssertionError, match=f"unchecked request: {needle}"):
        asyncio.run(generate(engine, **fields))
    assert engine.load() == (0, 0) and runner.sessions == {}


def test_a_method_the_runner_refuses_fails_the_request_as_internal(engine_runner):
    """The wire checks a method against the model (wire.method_spec); one the runner still refuses is a bug: the
    request ends INTERNAL, alone, and leaks no session."""
    engine, runner = engine_runner
    events, error = asyncio.run(generate(engine, text="a", method=MethodSpec.of("retopk", top_k=0)))
    assert events == [] and error.code is ErrorCode.INTERNAL and "top_k" in error.message
    # after the error the engine probes its runner (engine/faults.py: a session of the default method, opened and
    # closed on the engine thread), so the probe's session may still be open for a moment; a leak stays
    deadline = time.monotonic() + 5.0
    while runner.sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.sessions == {}
    events, error = asyncio.run(generate(engine, text="hi", max_new_tokens=2))
    assert error is None and len(tokens(events)) == 2  # the engine goes on


def test_context_length_finishes_the_request():
    engine, _ = make_engine(FakeRunner(max_context=20))
    try:
        events, error = asyncio.run(generate(engine, text="x" * 15, max_new_tokens=100))
    finally:
        engine.stop()
    assert error is None and events[-1].finish_reason is FinishReason.CONTEXT_LENGTH
    assert len(tokens(events)) == 6  # positions 15..19 filled by fed tokens, plus the last unfed one


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
