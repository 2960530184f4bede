"""Fault injection: an exception in sampling, decode, prefill, an allocation failure, a hook, the loop.

Each per-request fault ends only the request it hit, with a status naming the stage; the requests
batched with it finish with exactly the tokens they get alone (``fake_runner.greedy_reference``), and
the engine keeps serving. A broken runner (the probe fails too) or a dead loop ends the engine:
queued and running requests get UNAVAILABLE, health turns NOT_SERVING and ``serve`` exits with 70. So does
a loop that hangs with work pending (the watchdog, engine/supervision.py: here a decode step held on the
fake's gate past a short --watchdog-timeout-s), and a failure during a drain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.config import ServerConfig
from retopk_server.engine import EngineError, EngineObserver, ErrorCode, GenerationRequest, RequestStream
from retopk_server.engine.faults import EngineHung, RunnerBroken
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling import Sampler, SamplingParams
from retopk_server.service.health import EXIT_ENGINE_FAILED, READINESS
from retopk_server.service.server import serve
from tests._live_server import free_port
from tests.server.conftest import FakeServer
from tests.server.engine.engine_helpers import collect, enc, make_engine, tokens
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)

POISON = "!"  # a prompt holding it triggers the injected fault
GOOD = ("hello", "abc", "fault-free", "zz")


class FaultyRunner(FakeRunner):
    """The fake model, failing where told: ``fail[stage]`` is the exception that stage raises for a poisoned
    session (one whose tokens hold POISON); ``broken`` makes every prefill and decode raise."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.fail: dict[str, BaseException] = {}
        self.broken = False
        self.attempts: list[int] = []  # the batch size of every decode call, failed ones too

    @staticmethod
    def _poisoned(tokens) -> bool:
        return ord(POISON) in tokens

    def start_prefill(self, session, token_ids, prefix_key=None):
        job = super().start_prefill(session, token_ids, prefix_key)
        if self.broken or ("prefill" in self.fail and self._poisoned(token_ids)):
            error = self.fail.get("prefill", RuntimeError("device lost"))

            def step(max_tokens):  # fails inside the prefill's forward, as a model error would
                raise error

            job.step = step
        return job

    def reserve(self, session, length):
        if "reserve" in self.fail and self._poisoned(session.token_ids) and length == session.length + 1:
            raise self.fail["reserve"]  # the next token's KV block, before a decode step
        return super().reserve(session, length)

    def decode(self, sessions, token_ids, with_stats=False):
        self.attempts.append(len(sessions))
        if self.broken or ("decode" in self.fail and any(self._poisoned(s.token_ids) for s in sessions)):
            raise self.fail.get("decode", RuntimeError("device lost"))
        return super().decode(sessions, token_ids, with_stats)


def submit(engine, text: str, max_new_tokens: int = 8, **fields) -> RequestStream:
    stream = RequestStream()
    engine.submit(GenerationRequest(request_id=text, text=text, max_new_tokens=max_new_tokens, **fields), stream)
    return stream


async def run_batch(engine, texts, max_new_tokens: int = 8, **fields):
    """Submit every text at once (they share the decode batch) -> {text: (tokens, error)}."""
    streams = {t: submit(engine, t, max_new_tokens, **fields) for t in texts}
    results = await asyncio.gather(*(collect(s) for s in streams.values()))
    return {t: (tokens(events), error) for t, (events, error) in zip(streams, results, strict=True)}


def assert_isolated(results, poisoned: str, code: ErrorCode, *words: str) -> None:
    """The poisoned request failed with ``code`` and a message holding ``words``; the others match the reference."""
    _, error = results[poisoned]
    assert error is not None and error.code is code, error
    assert all(w in error.message for w in words), error.message
    for text, (got, err) in results.items():
        if text != poisoned:
            assert err is None and got == greedy_reference(enc(text), 8), (text, err)


def still_serves(engine) -> None:
    got, error = asyncio.run(run_batch(engine, ["again"]))["again"]
    assert error is None and got == greedy_reference(enc("again"), 8)
    assert engine.alive and engine.failure is None


@pytest.fixture
def faulty():
    runner = FaultyRunner()
    engine, _ = make_engine(runner)
    yield engine, runner
    engine.stop()


@pytest.mark.parametrize("at_step", [0, 3])  # 0: the token sampled right after prefill; 3: in a decode step
def test_sampling_failure_ends_only_its_request(faulty, monkeypatch, at_step):
    engine, _ = faulty
    real = Sampler.sample

    def sample(self, logits, generated, context):
        if self.params.seed == 666 and len(generated) == at_step:
            raise FloatingPointError("injected sampling fault")
        return real(self, logits, generated, context)

    monkeypatch.setattr(Sampler, "sample", sample)

    async def batch():
        streams = {t: submit(engine, t) for t in GOOD}
        # a sampled row (temperature > 0): the batch's plain greedy rows share one argmax, this one draws alone
        streams["bad"] = submit(engine, "bad", sampling=SamplingParams(temperature=0.7, seed=666))
        return {t: (tokens(ev), err) for t, (ev, err) in
                zip(streams, await asyncio.gather(*(collect(s) for s in streams.values())), strict=True)}

    results = asyncio.run(batch())
    assert_isolated(results, "bad", ErrorCode.INTERNAL, "sampling failed", "FloatingPointError", "injected")
    assert len(results["bad"][0]) == at_step  # the tokens before the fault were streamed
    still_serves(engine)


def test_a_failing_batched_argmax_leaves_each_row_to_its_own_sampler(faulty, monkeypatch):
    """The plain greedy rows' one argmax over the batch fails: every row is sampled on its own instead, and
    each still gets the reference's tokens."""
    import retopk_server.engine.loop as loop

    engine, _ = faulty

    def broken(samplers, logits):
        raise FloatingPointError("injected argmax fault")

    monkeypatch.setattr(loop, "greedy_tokens", broken)
    results = asyncio.run(run_batch(engine, GOOD))
    for text, (got, err) in results.items():
        assert err is None and got == greedy_reference(enc(text), 8), (text, err)
    still_serves(engine)


def test_sampling_failure_keeps_a_named_session_consistent(faulty, monkeypatch):
    """The token fed by the last decode step is in the cache; the next turn must not feed it again."""
    engine, runner = faulty
    engine.commands.create_session("s", None).result(10)
    real = Sampler.sample

    def sample(self, logits, generated, context):
        if len(generated) == 2:  # after the decode step that fed the second token
            raise ValueError("injected")
        return real(self, logits, generated, context)

    monkeypatch.setattr(Sampler, "sample", sample)
    events, error = asyncio.run(turn(engine, "hey", 8, logprobs=True))  # greedy, but sampled row by row
    assert error is not None and error.code is ErrorCode.INTERNAL and len(tokens(events)) == 2
    monkeypatch.setattr(Sampler, "sample", real)
    events, error = asyncio.run(turn(engine, "yo", 3))
    assert error is None
    context = enc("hey") + greedy_reference(enc("hey"), 2) + enc("yo")
    session = next(iter(runner.sessions.values()))
    assert session.token_ids[:len(context)] == context  # each generated token fed exactly once
    assert tokens(events) == greedy_reference(context, 3)


async def turn(engine, text: str, max_new_tokens: int, **fields):
    stream = RequestStream()
    engine.submit(GenerationRequest(request_id=text, text=text, session_id="s", max_new_tokens=max_new_tokens,
                                    **fields), stream)
    return await collect(stream)


@pytest.mark.parametrize("exc, code, words", [
    (RuntimeError("injected decode fault"), ErrorCode.INTERNAL, ("decode failed", "injected decode fault")),
    (torch.OutOfMemoryError("CUDA out of memory"), ErrorCode.RESOURCE_EXHAUSTED, ("out of memory during decode",)),
    (MemoryError(), ErrorCode.RESOURCE_EXHAUSTED, ("out of memory during decode",)),
])
def test_decode_failure_ends_only_the_row_that_fails_alone(faulty, exc, code, words):
    engine, runner = faulty
    runner.fail["decode"] = exc
    results = asyncio.run(run_batch(engine, [*GOOD, "bad" + POISON]))
    assert_isolated(results, "bad" + POISON, code, *words)
    assert max(runner.attempts) == len(GOOD) + 1  # the fault hit a shared batch
    still_serves(engine)


@pytest.mark.parametrize("exc, code, words", [
    (RuntimeError("injected prefill fault"), ErrorCode.INTERNAL, ("prefill failed", "injected prefill fault")),
    (MemoryError("cannot allocate KV blocks"), ErrorCode.RESOURCE_EXHAUSTED,
     ("out of memory during prefill", "cannot allocate KV blocks")),
])
def test_prefill_failure_ends_only_its_request(faulty, exc, code, words):
    engine, runner = faulty
    runner.fail["prefill"] = exc
    results = asyncio.run(run_batch(engine, [*GOOD[:2], "bad" + POISON, *GOOD[2:]]))
    assert_isolated(results, "bad" + POISON, code, *words)
    still_serves(engine)


def test_allocation_failure_reserving_the_next_block_ends_only_its_request(faulty):
    engine, runner = faulty
    runner.fail["reserve"] = MemoryError("no KV block")
    results = asyncio.run(run_batch(engine, [*GOOD, "bad" + POISON]))
    assert_isolated(results, "bad" + POISON, ErrorCode.RESOURCE_EXHAUSTED,
                    "out of memory during reserving the next KV block", "no KV block")
    still_serves(engine)


def test_allocation_failure_opening_a_session(faulty, monkeypatch):
    engine, runner = faulty
    real = runner.open_session

    def open_session(method=None, session_id=None):
        if method is not None and dict(method.params).get("top_k") == 5:
            raise MemoryError("method state")
        return real(method, session_id)

    monkeypatch.setattr(runner, "open_session", open_session)

    async def both():
        bad = submit(engine, "x", method=MethodSpec.of("retopk", top_k=5))
        good = submit(engine, "hello")
        return await asyncio.gather(collect(bad), collect(good))

    (_, error), (events, ok) = asyncio.run(both())
    assert error.code is ErrorCode.RESOURCE_EXHAUSTED and "out of memory during prefill" in error.message
    assert ok is None and tokens(events) == greedy_reference(enc("hello"), 8)
    still_serves(engine)


def test_failing_observer_hooks_do_not_stop_streams():
    class Broken(EngineObserver):
        def on_token(self, *args):
            raise RuntimeError("metrics bug")

        def on_step(self, *args):
            raise RuntimeError("metrics bug")

    engine, _ = make_engine(FaultyRunner(), observer=Broken())
    try:
        results = asyncio.run(run_batch(engine, GOOD))
        assert all(err is None and got == greedy_reference(enc(t), 8) for t, (got, err) in results.items())
        still_serves(engine)
    finally:
        engine.stop()


# --- unrecoverable: the engine ends, health says so -----------------------------------------------------
def test_broken_runner_fails_the_engine_and_everything_it_holds(faulty):
    engine, runner = faulty
    gate = threading.Event()
    runner.gate = gate  # hold the first decode step until every request is in

    async def held():
        streams = [submit(engine, t, max_new_tokens=50) for t in GOOD]
        while engine.load()[1] < len(GOOD):
            await asyncio.sleep(0.01)
        streams.append(submit(engine, "late", max_new_tokens=2))  # queued behind the held step
        runner.broken = True
        gate.set()
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(held())
    codes = {error.code for _, error in results}
    assert codes <= {ErrorCode.INTERNAL, ErrorCode.UNAVAILABLE} and ErrorCode.UNAVAILABLE in codes
    assert any("engine failed" in error.message for _, error in results)
    engine.join(10)
    assert not engine.alive and isinstance(engine.failure, Exception) and "probe" in str(engine.failure)

    async def after():
        with pytest.raises(EngineError) as refused:
            submit(engine, "after")
        return refused.value.code

    assert asyncio.run(after()) is ErrorCode.UNAVAILABLE
    with pytest.raises(EngineError):  # commands too: the queue is closed
        engine.commands.status().result(5)


def test_runner_broken_exception_needs_no_probe(faulty):
    engine, runner = faulty
    runner.fail["decode"] = RunnerBroken("context poisoned")
    results = asyncio.run(run_batch(engine, ["only" + POISON]))
    assert results["only" + POISON][1].code is ErrorCode.INTERNAL
    engine.join(10)
    assert isinstance(engine.failure, Exception) and "context poisoned" in str(engine.failure)


def test_a_dying_loop_turns_health_not_serving():
    runner = FaultyRunner()
    server = FakeServer(runner)
    try:
        health = health_pb2_grpc.HealthStub(server.channel)
        for name in ("", READINESS):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == 1  # SERVING
        server.engine.sessions.expire_idle = lambda: 1 / 0  # the loop itself raises
        with server.engine.scheduler.lock:
            server.engine.scheduler.lock.notify_all()
        server.engine.join(10)
        assert isinstance(server.engine.failure, ZeroDivisionError)
        for name in ("", READINESS):
            while health.Check(health_pb2.HealthCheckRequest(service=name)).status != 2:  # NOT_SERVING
                pass
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub.Generate(pb.GenerateRequest(text="hi")))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()


def test_serve_exits_nonzero_when_the_runner_breaks():
    """The real ``serve`` (signal handlers need the main thread): a request breaks the runner, the
    stream gets its status, and serve returns EXIT_ENGINE_FAILED instead of hanging."""
    runner = FaultyRunner()
    runner.fail["decode"] = RunnerBroken("device lost")
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, metrics_port=0, drain_grace_s=1.0)
    seen: dict = {}

    def client():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(30)
            try:
                list(pb_grpc.ReTopKServiceStub(channel).Generate(pb.GenerateRequest(text="x" + POISON)))
            except grpc.RpcError as e:
                seen["code"], seen["details"] = e.code(), e.details()

    thread = threading.Thread(target=client)
    thread.start()
    code = asyncio.run(asyncio.wait_for(serve(config, runner_factory=lambda: runner), 40))
    thread.join(10)
    assert code == EXIT_ENGINE_FAILED
    assert seen["code"] == grpc.StatusCode.INTERNAL and "device lost" in seen["details"]


def serve_with(runner, client, **config) -> int:
    """Run the real ``serve`` (signal handlers need the main thread) on a free port while ``client(port)``
    runs in a thread; returns serve's exit code."""
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, metrics_port=0, **config)
    thread = threading.Thread(target=client, args=(port,))
    thread.start()
    try:
        return asyncio.run(asyncio.wait_for(serve(config, runner_factory=lambda: runner), 40))
    finally:
        if runner.gate is not None:
            runner.gate.set()  # a held step may end now
        thread.join(10)


def held_stream(channel):
    """A Generate whose first token is out (sampled after the prefill); its first decode step then waits."""
    grpc.channel_ready_future(channel).result(30)
    stream = pb_grpc.ReTopKServiceStub(channel).Generate(pb.GenerateRequest(text="held", max_new_tokens=50))
    next(stream)
    return stream


def test_serve_exits_nonzero_when_the_engine_fails_during_a_drain():
    """SIGTERM starts a drain; the runner breaks under the stream the drain waits for: exit 70, not 0."""
    runner = FaultyRunner(gate=threading.Event())
    seen: dict = {}

    def client(port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = held_stream(channel)
            os.kill(os.getpid(), signal.SIGTERM)  # serve's handler: drain
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(service=READINESS)).status != 2:  # draining
                time.sleep(0.01)
            runner.broken = True
            runner.gate.set()
            try:
                list(stream)
            except grpc.RpcError as e:
                seen["code"] = e.code()

    assert serve_with(runner, client, drain_grace_s=30.0) == EXIT_ENGINE_FAILED
    assert seen["code"] == grpc.StatusCode.INTERNAL  # its decode step failed; the probe then failed too


# --- a hung engine: the watchdog ------------------------------------------------------------------------
def test_the_watchdog_counts_only_a_loop_stuck_with_work_pending():
    engine, _ = make_engine(FaultyRunner(), watchdog_timeout_s=0.3)
    stuck, release = threading.Event(), threading.Event()
    sweep = engine.sessions.expire_idle

    def expire_idle():  # the loop hangs in its idle-session sweep, holding no request
        stuck.set()
        release.wait()
        return sweep()

    engine.sessions.expire_idle = expire_idle
    try:
        assert stuck.wait(10)
        while time.monotonic() - engine.supervision.last_beat <= 0.3:
            time.sleep(0.05)
        assert not engine.check_hung() and engine.alive  # stuck past the timeout, but nothing waits on it
        status = engine.commands.status()  # now a command does
        assert engine.check_hung() and isinstance(engine.failure, EngineHung) and not engine.alive
        assert "made no progress" in str(engine.failure)
        with pytest.raises(EngineError) as failed:
            status.result(5)
        assert failed.value.code is ErrorCode.UNAVAILABLE

        async def after():
            with pytest.raises(EngineError) as refused:
                submit(engine, "after")
            return refused.value.code

        assert asyncio.run(after()) is ErrorCode.UNAVAILABLE
    finally:
        release.set()
        engine.stop()


def test_a_hung_decode_step_turns_health_not_serving_and_ends_its_stream():
    runner = FaultyRunner(gate=threading.Event())  # never set: the first decode step hangs
    server = FakeServer(runner, watchdog_timeout_s=1.0)
    try:
        health = health_pb2_grpc.HealthStub(server.channel)
        stream = held_stream(server.channel)
        with pytest.raises(grpc.RpcError) as ended:
            list(stream)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine failed" in ended.value.details() and "made no progress" in ended.value.details()
        assert isinstance(server.engine.failure, EngineHung) and not server.engine.alive
        for name in ("", READINESS):
            while health.Check(health_pb2.HealthCheckRequest(service=name)).status != 2:  # NOT_SERVING
                time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub.Generate(pb.GenerateRequest(text="hi")))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        runner.gate.set()
        server.close()


def test_serve_exits_nonzero_when_the_engine_hangs():
    runner = FaultyRunner(gate=threading.Event())
    seen: dict = {}

    def client(port):
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                list(held_stream(channel))
            except grpc.RpcError as e:
                seen["code"], seen["details"] = e.code(), e.details()

    assert serve_with(runner, client, watchdog_timeout_s=1.0) == EXIT_ENGINE_FAILED
    assert seen["code"] == grpc.StatusCode.UNAVAILABLE and "made no progress" in seen["details"]


def test_the_watchdog_timeout_is_a_flag_and_an_environment_variable(capsys):
    from retopk_server.cli import config_from

    assert config_from([], {}).engine_config().watchdog_timeout_s == 300.0
    assert config_from(["--watchdog-timeout-s", "none"], {}).engine_config().watchdog_timeout_s is None
    assert config_from([], {"RETOPK_WATCHDOG_TIMEOUT_S": "2.5"}).engine_config().watchdog_timeout_s == 2.5
    with pytest.raises(SystemExit) as refused:
        config_from(["--watchdog-timeout-s", "0"], {})
    assert refused.value.code == 2 and "watchdog_timeout_s must be a positive number" in capsys.readouterr().err
