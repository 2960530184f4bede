"""The engine under a cache budget, with the fake runner (kv_blocks = its budget in 16-token blocks):
idle sessions are evicted least recently used first and their owners told so, a request that cannot fit
is RESOURCE_EXHAUSTED without evicting anyone in vain, a running request that outgrows the budget ends
alone, and the status, metrics and observer count it all.

Expected tokens come from ``fake_runner.greedy_reference`` (the fake model's definition).
"""

from __future__ import annotations

import asyncio

import pytest

from retopk_server.engine import EngineError, EngineObserver, ErrorCode
from retopk_server.metrics import MetricsObserver
from tests.server.engine.engine_helpers import enc, generate, make_engine, tokens
from tests.server.fake_runner import BLOCK, FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)


class Evictions(EngineObserver):
    def __init__(self) -> None:
        self.evicted: list[str] = []

    def on_session_evicted(self, session_id: str) -> None:
        self.evicted.append(session_id)


def turn(engine, session_id: str | None, text: str, n: int = 2):
    return asyncio.run(generate(engine, text=text, session_id=session_id, max_new_tokens=n, ignore_eos=True))


def test_idle_sessions_are_evicted_least_recently_used_first_and_their_owners_told():
    observer = Evictions()
    engine, runner = make_engine(FakeRunner(kv_blocks=6), observer, max_sessions=8)
    try:
        for name in ("a", "b", "c"):
            engine.commands.create_session(name, None).result()
        for name in ("a", "b", "c"):  # 20 + 2 tokens each: 2 blocks, 6 of 6 held
            _, error = turn(engine, name, f"{name} " * 10)
            assert error is None
        _, error = turn(engine, "a", "x")  # "a" is now the most recently used, "b" the least
        assert error is None and runner.used_blocks() == 6
        events, error = turn(engine, None, "p" * 20)  # an ephemeral request needs 2 blocks
        assert error is None and tokens(events) == greedy_reference(enc("p" * 20), 2, stop_at_eos=False)
        assert observer.evicted == ["b"]
        with pytest.raises(EngineError) as info:  # refused at submission
            turn(engine, "b", "again")
        assert info.value.code is ErrorCode.NOT_FOUND and "evicted" in info.value.message
        assert "'b'" in info.value.message
        with pytest.raises(Exception) as info:
            engine.commands.get_session("b").result()
        assert info.value.code is ErrorCode.NOT_FOUND and "evicted" in info.value.message
        assert {s.session_id for s in engine.commands.list_sessions().result()} == {"a", "c"}
        status = engine.commands.status().result()
        assert status.sessions_evicted == 1 and status.cache_budget_bytes == 6 * 64
        # a never-created id is plain NOT_FOUND, and a re-created "b" is a fresh session
        with pytest.raises(EngineError) as info:
            turn(engine, "zz", "x")
        assert info.value.code is ErrorCode.NOT_FOUND and "evicted" not in info.value.message
        engine.commands.create_session("b", None).result()
        assert engine.commands.get_session("b").result().num_tokens == 0
    finally:
        engine.stop()


def test_a_prompt_larger_than_the_budget_is_resource_exhausted_and_evicts_nobody():
    observer = Evictions()
    engine, runner = make_engine(FakeRunner(kv_blocks=4), observer)
    try:
        engine.commands.create_session("keep", None).result()
        assert turn(engine, "keep", "k" * 20)[1] is None
        _, error = turn(engine, None, "p" * (5 * BLOCK))  # 5 blocks > the whole budget of 4
        assert error.code is ErrorCode.RESOURCE_EXHAUSTED and "kv_cache_bytes" in error.message
        assert observer.evicted == [] and engine.commands.get_session("keep").result().num_tokens == 22
        # 3 blocks fit only once "keep" (2 blocks) is evicted: that eviction is not in vain
        _, error = turn(engine, None, "q" * (2 * BLOCK + 4))
        assert error is None and observer.evicted == ["keep"]
        assert runner.used_blocks() == 0
    finally:
        engine.stop()


def test_busy_sessions_are_never_evicted_and_a_request_that_cannot_grow_ends_alone():
    """Two requests decoding past the budget: the one whose next block does not fit ends
    RESOURCE_EXHAUSTED, the other finishes with the reference tokens; no busy session is evicted."""
    observer = Evictions()
    engine, runner = make_engine(FakeRunner(kv_blocks=4, step_delay_s=0.001), observer, max_running=2)

    async def both():
        return await asyncio.gather(*(generate(engine, text=c * BLOCK, max_new_tokens=40, ignore_eos=True,
                                               request_id=c) for c in "ab"))

    try:
        results = asyncio.run(both())
    finally:
        engine.stop()
    errors = [e for _, e in results if e is not None]
    assert len(errors) == 1 and errors[0].code is ErrorCode.RESOURCE_EXHAUSTED
    assert "decoding the next token" in errors[0].message
    (ok,) = [i for i, (_, e) in enumerate(results) if e is None]
    assert tokens(results[ok][0]) == greedy_reference(enc("ab"[ok] * BLOCK), 40, stop_at_eos=False)
    assert observer.evicted == [] and runner.sessions == {}


def test_method_state_that_does_not_fit_is_resource_exhausted(monkeypatch):
    from retopk_server.runtime.budget import BudgetExceeded

    engine, runner = make_engine(FakeRunner())
    real = runner.open_session

    def refuse(method=None, session_id=None):
        if method is not None and dict(method.params).get("top_k") == 99:
            raise BudgetExceeded("the method state", 10 ** 9, 0, 100)
        return real(method, session_id)

    monkeypatch.setattr(runner, "open_session", refuse)
    try:
        from retopk_server.runtime.method_spec import MethodSpec

        with pytest.raises(Exception) as info:
            engine.commands.create_session("big", MethodSpec("retopk", (("top_k", 99),))).result()
        assert info.value.code is ErrorCode.RESOURCE_EXHAUSTED and "method state" in info.value.message
        assert engine.commands.create_session("small", None).result().session_id == "small"
    finally:
        engine.stop()


def test_metrics_report_the_budget_its_utilisation_and_the_evictions():
    from tests.server.test_metrics import scrape, value

    observer = MetricsObserver("fake", per_head=False, memory_interval_s=0.0)
    engine, runner = make_engine(FakeRunner(kv_blocks=4), observer)
    try:
        for name in ("a", "b"):
            engine.commands.create_session(name, None).result()
            assert turn(engine, name, name * 20)[1] is None  # 2 blocks each
        assert turn(engine, None, "c" * 20)[1] is None  # evicts "a"
        engine.commands.status().result()  # the engine has run its last iteration's hooks
        samples = scrape(observer.metrics)
        assert value(samples, "retopk_sessions_evicted_total", model="fake") == 1
        assert value(samples, "retopk_cache_budget_bytes", model="fake") == 4 * 64
        # "b" holds 2 of 4 blocks plus its method state (FakeRunner: 32 bytes)
        assert value(samples, "retopk_kv_cache_utilization_ratio", model="fake") == (2 * 64 + 32) / (4 * 64)
    finally:
        engine.stop()


def test_the_budget_flags_reach_the_runtime_and_the_engine():
    from retopk_server.cli import config_from

    config = config_from(["--kv-cache-bytes", "256MiB", "--max-step-tokens", "64"], {})
    assert config.runtime_config().kv_cache_bytes == 256 * 2 ** 20 and config.engine_config().max_step_tokens == 64
    assert config_from([], {"RETOPK_KV_CACHE_BYTES": "1e9"}).kv_cache_bytes == 10 ** 9
    assert config_from([], {"RETOPK_KV_CACHE_FRACTION": "0.25"}).runtime_config().kv_cache_fraction == 0.25
    assert config_from([], {}).kv_cache_bytes is None  # the default: a fraction of the free memory
    for bad in (["--kv-cache-bytes", "12parsecs"], ["--kv-cache-bytes", "-1"], ["--kv-cache-fraction", "0"],
                ["--max-step-tokens", "0"]):
        with pytest.raises(SystemExit):
            config_from(bad, {})


def test_evictions_are_remembered_per_key(monkeypatch):
    """docs/reliability.md: each key's last EVICTED_REMEMBERED evictions are remembered, so another key's many
    evictions do not turn bob's "was evicted" into a plain NOT_FOUND."""
    from retopk_server.engine import session_table as sessions_module
    from retopk_server.engine.requests import EngineConfig

    monkeypatch.setattr(sessions_module, "EVICTED_REMEMBERED", 2)
    table = sessions_module.SessionTable(EngineConfig(max_sessions=100), lambda *args: None)
    table.runner = FakeRunner()
    table.create("b1", None, owner="bob")
    assert table.evict_lru()
    for i in range(3):  # alice's evictions: more than the number remembered
        table.create(f"a{i}", None, owner="alice")
        assert table.evict_lru()
    for owner, session_id, evicted in (("bob", "b1", True), ("alice", "a0", False), ("alice", "a2", True),
                                       ("alice", "b1", False)):
        with pytest.raises(EngineError) as info:
            table.get(session_id, owner)
        assert ("was evicted" in info.value.message) is evicted, (owner, session_id)
