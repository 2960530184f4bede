"""The sessions of the requests that end in one decode step close together (SessionTable.closing,
runner.close_sessions) before the step's events reach their streams: the n = 4 choices of a request, which end in
the same step, close in one call, each stream still gets what it got before, and a client that sees the last event
finds the sessions closed. A failed close is logged, and the step's events still arrive."""

from __future__ import annotations

import asyncio
import logging

import pytest

from retopk_server.engine import GenerationRequest, RequestStream
from retopk_server.runtime.sampling import SamplingParams
from tests.server.engine.engine_helpers import collect, enc, make_engine, tokens
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


class CountingRunner(FakeRunner):
    """Records each close_sessions call's session count; ``fail``: the next call raises after closing."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.calls: list[int] = []
        self.fail = False

    def close_sessions(self, sessions) -> None:
        self.calls.append(len(sessions))
        super().close_sessions(sessions)
        if self.fail:
            self.fail = False
            raise RuntimeError("closing failed")


def run_n4(runner: CountingRunner):
    engine, _ = make_engine(runner)

    async def main():
        stream = RequestStream()
        engine.submit(GenerationRequest(request_id="r", text="abcd", max_new_tokens=6, ignore_eos=True, n=4,
                                        sampling=SamplingParams()), stream)
        events, error = await collect(stream)
        return events, error, dict(runner.sessions)  # read when the stream ended

    try:
        return asyncio.run(main())
    finally:
        engine.stop()


def test_the_choices_that_end_in_one_step_close_in_one_call_before_their_last_events():
    runner = CountingRunner()
    events, error, open_at_end = run_n4(runner)
    assert error is None and open_at_end == {}
    assert runner.calls == [4]  # the 4 choices' sessions (the prompt's and its 3 forks), in one call
    expected = greedy_reference(enc("abcd"), 6, stop_at_eos=False)
    for index in range(4):
        assert tokens([e for e in events if e.index == index]) == expected
    assert sum(e.finish_reason is not None for e in events) == 4


def test_a_failed_close_is_logged_and_the_events_still_arrive(caplog):
    runner = CountingRunner()
    runner.fail = True
    with caplog.at_level(logging.ERROR, logger="retopk_server.engine"):
        events, error, open_at_end = run_n4(runner)
    assert error is None and open_at_end == {}
    assert sum(e.finish_reason is not None for e in events) == 4
    assert any("closing 4 ended requests' sessions failed" in r.getMessage() for r in caplog.records)
