"""The engine around its loop with a fake runner: the queue's limit, cancellation and deadlines, draining,
``in_flight``, stopping."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from retopk_server.engine import EngineError, EngineObserver, ErrorCode, GenerationRequest, RequestStream
from tests.server.engine.engine_helpers import collect, enc, generate, make_engine, tokens
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


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
