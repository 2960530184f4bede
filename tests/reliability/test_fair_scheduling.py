"""Fair scheduling with the fake runner: a long prompt is prefilled in chunks within the iteration's
token budget, interleaved with the running streams' decode steps; commands are answered between chunks;
cancellation and deadlines are checked between chunks and, for a queued request, at once.

Expected tokens come from ``fake_runner.greedy_reference`` (the fake model's definition, one request alone).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from retopk_server.engine import ErrorCode, GenerationRequest, RequestStream
from tests.server.engine.engine_helpers import collect, enc, generate, make_engine, tokens
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


def prefill_chunks(log: list[tuple[str, int]]) -> list[int]:
    return [n for kind, n in log if kind == "prefill"]


def test_a_long_prompt_is_prefilled_in_chunks_between_the_running_streams_decode_steps():
    budget = 8
    engine, runner = make_engine(FakeRunner(step_delay_s=0.001), max_running=4, max_step_tokens=budget)
    long_prompt = "the long prompt " * 10  # 160 tokens

    async def main():
        first = RequestStream()
        engine.submit(GenerationRequest("short", text="hi", max_new_tokens=60, ignore_eos=True), first)
        await first.__anext__()  # running
        long = asyncio.ensure_future(generate(engine, text=long_prompt, max_new_tokens=5, request_id="long"))
        head, error = await collect(first)
        return head, error, await long

    try:
        rest, error, (long_events, long_error) = asyncio.run(main())
    finally:
        engine.stop()
    assert error is None and long_error is None
    assert len(rest) + 1 == 60
    assert tokens(long_events) == greedy_reference(enc(long_prompt), 5)  # chunking changes nothing
    log = runner.log
    # every prompt chunk fed, each inside a ("prefill_together", jobs) entry: the first is the short prompt's
    long_chunks = [i for i, (kind, _) in enumerate(log) if kind == "prefill"][1:]
    # the long prompt's chunks: each within the budget left by the one running stream, together the prompt
    sizes = [log[i][1] for i in long_chunks]
    assert sum(sizes) == len(long_prompt) and max(sizes) <= budget - 1 and len(sizes) >= len(long_prompt) // budget
    between = log[long_chunks[0]:long_chunks[-1]]
    assert sum(1 for kind, _ in between if kind == "decode") >= len(long_chunks) - 1  # a decode step after each


def test_status_is_answered_between_chunks_of_a_long_prefill():
    engine, runner = make_engine(FakeRunner(prefill_delay_s=0.02), max_step_tokens=4)
    prompt = "x" * 200  # 50 chunks

    async def main():
        stream = RequestStream()
        engine.submit(GenerationRequest("long", text=prompt, max_new_tokens=1), stream)
        while not prefill_chunks(runner.log):
            await asyncio.sleep(0.001)
        status = await asyncio.wrap_future(engine.commands.status())
        done_when_answered = sum(prefill_chunks(runner.log))
        sessions = await asyncio.wrap_future(engine.commands.list_sessions())
        events, error = await collect(stream)
        return status, done_when_answered, sessions, events, error

    try:
        status, done, sessions, events, error = asyncio.run(main())
    finally:
        engine.stop()
    assert done < len(prompt) and status.running == 1 and status.queued == 0
    assert sessions == [] and error is None and tokens(events) == greedy_reference(enc(prompt), 1)


def test_a_cancelled_queued_request_frees_its_queue_slot_and_session_at_once():
    """The engine thread is held inside a decode step (the gate): the withdrawal cannot be its work."""
    gate = threading.Event()
    engine, runner = make_engine(FakeRunner(gate=gate), max_running=1, max_queue=1)
    engine.commands.create_session("s", None).result()

    async def main():
        running = RequestStream()
        engine.submit(GenerationRequest("run", text="a", max_new_tokens=5), running)
        while not runner.batch_sizes:  # the engine is now blocked in decode
            await asyncio.sleep(0.001)
        queued = RequestStream()
        engine.submit(GenerationRequest("q", text="b", session_id="s", max_new_tokens=2), queued)
        queued.cancel()
        _, error = await collect(queued)
        load = engine.load()
        again = RequestStream()  # the queue slot and the session are free: this is accepted
        engine.submit(GenerationRequest("again", text="c", session_id="s", max_new_tokens=2), again)
        gate.set()
        return error, load, await collect(again), await collect(running)

    try:
        error, load, (again_events, again_error), (_, running_error) = asyncio.run(main())
    finally:
        gate.set()
        engine.stop()
    assert error.code is ErrorCode.CANCELLED and "queued" in error.message
    assert load == (0, 1)
    assert again_error is None and running_error is None
    assert tokens(again_events) == greedy_reference(enc("c"), 2)


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_request_dropped_while_prefilling_leaves_its_session_as_before(how):
    engine, runner = make_engine(FakeRunner(prefill_delay_s=0.01), max_step_tokens=4)
    engine.commands.create_session("s", None).result()
    try:
        first, error = asyncio.run(generate(engine, text="one ", session_id="s", max_new_tokens=3))
        assert error is None
        before = engine.commands.get_session("s").result()

        async def dropped():
            stream = RequestStream()
            deadline = time.monotonic() + 0.1 if how == "deadline" else None
            engine.submit(GenerationRequest("long", text="y" * 400, session_id="s", max_new_tokens=3,
                                            deadline=deadline), stream)
            if how == "cancel":
                while sum(prefill_chunks(runner.log)) < 20:
                    await asyncio.sleep(0.001)
                stream.cancel()
            return await collect(stream)

        _, error = asyncio.run(dropped())
        assert error.code is (ErrorCode.CANCELLED if how == "cancel" else ErrorCode.DEADLINE_EXCEEDED)
        if how == "deadline":
            assert "prefilling" in error.message
        after = engine.commands.get_session("s").result()
        assert (after.num_tokens, after.kv_bytes, after.busy) == (before.num_tokens, before.kv_bytes, False)
        # the next turn continues the conversation as if the dropped one never happened
        second, error = asyncio.run(generate(engine, text="two ", session_id="s", max_new_tokens=4))
        gen1 = greedy_reference(enc("one "), 3)
        assert error is None and tokens(second) == greedy_reference(enc("one ") + gen1 + enc("two "), 4)
    finally:
        engine.stop()


@pytest.mark.parametrize("cancel", [False, True])
def test_a_prompt_that_waits_for_a_prefill_under_way_keeps_its_place_and_can_be_cancelled_there(cancel):
    """Three prompts queue at once (the engine held in a decode step): A, then B which waits while A's prefill is
    under way (the fake's stand-in for a prompt that starts as A does, runner.waits_for_prefix), then C. C does
    not overtake B: B and C go in one forward once A's prompt is in. Cancelled while it waits, B ends as a queued
    request does and leaves its session as it was; C goes on."""
    gate = threading.Event()
    prompts = {"A": "shared start, then A", "B": "shared start, then B", "C": "C"}
    streams: dict[str, RequestStream] = {}
    waited = []

    def waits(ids, under_way):
        wait = ids[:12] == enc(prompts["A"][:12]) and any(job.token_ids[:12] == ids[:12] for job in under_way)
        if wait:
            waited.append(ids)
            if cancel:
                streams["B"].cancel()
        return wait

    runner = FakeRunner(gate=gate, waits=waits)
    plans = []  # the prompts of each shared prefill
    prefill_together = runner.prefill_together
    runner.prefill_together = lambda plan: plans.append({k for k, p in prompts.items() for job, _ in plan
                                                         if job.token_ids == enc(p)}) or prefill_together(plan)
    engine, _ = make_engine(runner, max_running=4, max_step_tokens=64)  # every prompt fits one iteration
    engine.commands.create_session("s", None).result()

    async def main():
        first = asyncio.ensure_future(generate(engine, text="a", max_new_tokens=2, request_id="first"))
        while ("decode", 1) not in runner.log:  # held at the gate
            await asyncio.sleep(0.001)
        for key, prompt in prompts.items():
            streams[key] = RequestStream()
            engine.submit(GenerationRequest(key, text=prompt, max_new_tokens=3,
                                            session_id="s" if key == "B" else None), streams[key])
        gate.set()
        return await first, {key: await collect(stream) for key, stream in streams.items()}

    try:
        (_, first_error), results = asyncio.run(main())
        session = engine.commands.get_session("s").result()
    finally:
        gate.set()
        engine.stop()
    assert first_error is None and waited == [enc(prompts["B"])]  # asked while A was under way, once
    served = [k for k in prompts if not (cancel and k == "B")]
    assert plans == [set(), {"A"}, set(served) - {"A"}]  # "a", then A alone, then the others in one forward
    for key in served:
        events, error = results[key]
        assert error is None and tokens(events) == greedy_reference(enc(prompts[key]), 3)
    if cancel:
        _, error = results["B"]
        assert error.code is ErrorCode.CANCELLED and "queued" in error.message
        assert (session.num_tokens, session.busy) == (0, False)
