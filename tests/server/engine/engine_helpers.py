"""Helpers of the engine tests: an Engine around a FakeRunner (no model), and running requests through it.

Expected tokens come from ``fake_runner.greedy_reference``, the fake model's definition applied one request
at a time, so every batched result is compared against the same request run alone.
"""

from __future__ import annotations

from retopk_server.engine import Engine, EngineConfig, EngineError, GenerationRequest, RequestStream
from tests.server.fake_runner import FakeRunner


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
