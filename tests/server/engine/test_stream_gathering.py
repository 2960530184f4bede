"""stream.gathered_sends: a decode step's sends reach the event loop in one call, each stream's items in their
order, the flags set at once; and through the engine, every stream still gets exactly what the request run alone
gets (stop strings, n > 1, a cancelled request), with one wake-up of the loop per batched step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from retopk_server.engine import EngineError, ErrorCode, FinishReason, GenerationRequest, RequestStream
from retopk_server.engine.requests import TokenEvent
from retopk_server.engine.stream import gathered_sends
from retopk_server.runtime.sampling import SamplingParams
from tests.server.engine.engine_helpers import collect, enc, make_engine, tokens
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


def count_wakeups(loop: asyncio.AbstractEventLoop) -> list:
    """Wrap the loop's call_soon_threadsafe to record the streams' calls (their callbacks put on a queue);
    returns the record."""
    calls, original = [], loop.call_soon_threadsafe

    def counted(callback, *args):
        if getattr(callback, "__name__", "") in ("_put_all", "put_nowait"):
            calls.append(callback)
        return original(callback, *args)

    loop.call_soon_threadsafe = counted
    return calls


def event(token: int, finish: FinishReason | None = None) -> TokenEvent:
    return TokenEvent([token], chr(token), token_index=0, finish_reason=finish)


def test_sends_inside_are_one_call_in_order_and_outside_one_call_each():
    async def main():
        loop = asyncio.get_running_loop()
        calls = count_wakeups(loop)
        a, b, c, after = RequestStream(), RequestStream(), RequestStream(), RequestStream()
        b.choices = 2  # n = 2: ends with its second finished event
        inside = {}

        def engine_thread():
            with gathered_sends():
                a.put(event(65))
                b.put(event(66, FinishReason.LENGTH))
                a.put(event(67, FinishReason.EOS_TOKEN))
                with gathered_sends():  # nested: the outer one sends
                    c.fail(EngineError(ErrorCode.INTERNAL, "boom"))
                b.put(event(68, FinishReason.LENGTH))
                inside["calls"], inside["closed"] = len(calls), (a.closed, b.closed, c.closed)
            after.put(event(69))
            after.put(event(70))

        thread = threading.Thread(target=engine_thread)
        thread.start()
        await asyncio.to_thread(thread.join)
        assert inside == {"calls": 0, "closed": (True, True, True)}  # flags at once, nothing sent yet
        assert len(calls) == 1 + 2  # the step's sends in one call; two outside, one each
        got_a, err_a = await collect(a)
        got_b, err_b = await collect(b)
        got_c, err_c = await collect(c)
        assert tokens(got_a) == [65, 67] and err_a is None
        assert tokens(got_b) == [66, 68] and err_b is None
        assert got_c == [] and err_c.code is ErrorCode.INTERNAL

    asyncio.run(main())


def test_a_gathered_send_to_a_closed_loop_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    stream = RequestStream(loop)
    loop.close()
    with gathered_sends():
        stream.put(event(65, FinishReason.LENGTH))
    assert stream.closed


STOP = "".join(map(chr, greedy_reference(enc("xyz"), 12, stop_at_eos=False)))[2:4]  # "om", met at the 4th token


def test_batched_streams_equal_each_request_alone_with_one_wakeup_per_step():
    """Four requests decoded together (stop strings, n = 2, one cancelled mid-way): each stream's tokens equal the
    fake model's run alone; the loop is woken once per decode step, not once per row."""
    runner = FakeRunner(step_delay_s=0.002)
    engine, _ = make_engine(runner)

    async def main():
        calls = count_wakeups(asyncio.get_running_loop())
        prompts = ["hello", "abcd", "xyz", "cancel me"]
        streams = [RequestStream() for _ in prompts]
        for i, (text, stream) in enumerate(zip(prompts, streams, strict=True)):
            fields = dict(max_new_tokens=12, ignore_eos=True)
            if i == 1:
                fields["n"] = 2
                fields["sampling"] = SamplingParams()
            if i == 2:
                fields["stop"] = [STOP]
            engine.submit(GenerationRequest(request_id=f"r{i}", text=text, **fields), stream)
        readers = [asyncio.create_task(collect(s)) for s in streams[:3]]
        cancelled = []
        async for e in streams[3]:
            cancelled.append(e)
            if len(cancelled) == 3:
                streams[3].cancel()
                break
        results = await asyncio.gather(*readers)
        return results, cancelled, calls

    try:
        (single, pair, third), cancelled, calls = asyncio.run(main())
    finally:
        engine.stop()
    assert single[1] is None and tokens(single[0]) == greedy_reference(enc("hello"), 12, stop_at_eos=False)
    text = "".join(map(chr, greedy_reference(enc("xyz"), 12, stop_at_eos=False)))
    assert third[1] is None and third[0][-1].finish_reason is FinishReason.STOP_SEQUENCE
    assert "".join(e.text for e in third[0]) == text[:text.index(STOP)]
    expected = greedy_reference(enc("abcd"), 12, stop_at_eos=False)
    for index in (0, 1):  # greedy: both choices the same tokens, each choice's events in order
        assert tokens([e for e in pair[0] if e.index == index]) == expected
    assert sum(e.finish_reason is not None for e in pair[0]) == 2
    assert tokens(cancelled) == greedy_reference(enc("cancel me"), 3, stop_at_eos=False)
    steps = len([b for b in runner.batch_sizes if b > 1])
    events = len(single[0]) + len(pair[0]) + len(third[0]) + len(cancelled)
    assert steps >= 10 and len(calls) < events - 2 * steps  # a step of k rows: one call, not k
