"""The gRPC service (servicer, validation, auth, health, reflection, drain) over a fake runner: fast, no model.

The same service code runs in the live-server tests with the real model; here every status code
path is exercised cheaply, each against the behaviour the proto documents.
"""

from __future__ import annotations

import math
import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from retopk_client.types import PATH_NAMES as CLIENT_PATH_NAMES
from retopk_client.types import StepStats as ClientStepStats
from retopk_core.methods.base import PATH_NAMES
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.cli import config_from
from retopk_server.runtime.runtime_config import DEFAULT_METHOD_PARAMS
from retopk_server.runtime.stats import StepStats
from retopk_server.service.wire import step_stats_message
from tests.server.fake_runner import EOS, FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)

USER = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, pb.SessionInfo):
            list(result)
    return info.value.code(), info.value.details()


# --- Generate ----------------------------------------------------------------------------------------
def test_generate_streams_tokens_text_usage_and_stats(fake_server):
    server = fake_server()
    out = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=5, request_id="r-1",
                                                       return_step_stats=True)))
    expected = greedy_reference(enc("hello"), 5)
    assert ids(out) == expected and "".join(r.text for r in out) == "".join(map(chr, expected))
    assert all(r.request_id == "r-1" for r in out)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in out[:-1])
    assert (out[-1].usage.prompt_tokens, out[-1].usage.generated_tokens) == (5, 5)
    stats = [s for r in out for s in r.step_stats]
    assert [s.token_index for s in stats] == [1, 2, 3, 4]  # token 0 comes from prefill
    assert all(s.num_layers == 2 and s.num_heads == 3 and len(s.path) == 6 and set(s.path) == {3} for s in stats)
    # one KV group per layer, read on every step (every head exact)
    assert all(s.num_kv_heads == 1 and list(s.group_read) == [True, True] for s in stats)


def test_step_stats_cross_the_wire_with_their_group_reads():
    """Runtime StepStats -> wire message (serialised) -> the client's StepStats: arrays row-major, group reads
    as written out by hand (a group of two heads is read when one of them took a full-read path)."""
    path = torch.tensor([[0, 0, 1, 0, 7, 2],  # groups: (reuse, reuse) (fallback, reuse) (promoted, refresh)
                         [0, 7, 0, 0, 3, 4]], dtype=torch.int8)  # (reuse, promoted) (reuse, reuse) (exact, dense)
    max_sim = torch.linspace(-1, 1, 12).reshape(2, 6)
    n_scored = torch.arange(12, dtype=torch.int32).reshape(2, 6)
    stats = StepStats(path, max_sim, n_scored, 0.25, num_kv_heads=3)
    msg = pb.StepStats.FromString(step_stats_message(stats, 4).SerializeToString())
    got = ClientStepStats.from_proto(msg)
    assert (got.token_index, got.num_layers, got.num_heads, got.num_kv_heads) == (4, 2, 6, 3)
    assert got.path == tuple(path.reshape(-1).tolist()) and got.n_scored == tuple(range(12))
    assert got.max_sim == pytest.approx(max_sim.reshape(-1).tolist())
    assert got.group_read == (False, True, True, True, False, True)
    assert got.group_read_rate() == pytest.approx(4 / 6)
    assert got.path_counts() == {"reuse": 6, "fallback": 1, "refresh": 1, "promoted": 2, "exact": 1, "dense": 1}
    assert got.attention_seconds == 0.25


def test_client_path_names_are_the_cores():
    """The client keeps its own copy of the path codes (it installs without the core): the same table."""
    assert CLIENT_PATH_NAMES == PATH_NAMES


def test_token_ids_and_stop_conditions(fake_server):
    server = fake_server()
    out = list(server.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=enc("ab.")), max_new_tokens=4)))
    assert ids(out) == [EOS] and out[-1].finish_reason == pb.FINISH_REASON_EOS_TOKEN
    ref = greedy_reference(enc("xyz"), 8)
    out = list(server.stub.Generate(pb.GenerateRequest(text="xyz", max_new_tokens=8, stop_token_ids=[ref[1]])))
    assert ids(out) == ref[:2] and out[-1].finish_reason == pb.FINISH_REASON_STOP_TOKEN
    out = list(server.stub.Generate(pb.GenerateRequest(text="xyz", max_new_tokens=8, stop=[chr(ref[2])])))
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert "".join(r.text for r in out) == "".join(map(chr, ref[:2]))


def test_logprobs_are_the_log_softmax_of_the_sampled_distribution(fake_server):
    """The fake's logits are 10 on its next token and 0 on the other 127, so log_softmax is known by hand:
    unset sampling takes the server's default temperature (0.7; its top_p 0.9 keeps only that token), and
    temperature 0 (greedy) reports the logits at T = 1."""
    server = fake_server()
    expected = greedy_reference(enc("hello"), 3)
    for sampling, T in ((None, 0.7), (pb.SamplingParameters(temperature=0), 1.0)):
        out = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=3, logprobs=True,
                                                           top_logprobs=3, sampling=sampling)))
        lps = [lp for r in out for lp in r.logprobs]
        assert ids(out) == expected == [lp.token_id for lp in lps]  # one per token, in order
        assert all(len(r.logprobs) == len(r.token_ids) for r in out)
        lse = math.log(math.exp(10 / T) + 127)
        for lp in lps:
            assert lp.logprob == pytest.approx(10 / T - lse, abs=1e-4)
            assert lp.top[0].token_id == lp.token_id  # greedy: the sampled token is the most likely
            assert [t.logprob for t in lp.top] == pytest.approx([10 / T - lse, -lse, -lse], abs=1e-4)
            assert lp.token == chr(lp.token_id) and [t.token for t in lp.top] == [chr(t.token_id) for t in lp.top]
    just = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=2, logprobs=True)))
    assert all(len(lp.top) == 0 for r in just for lp in r.logprobs) and len(ids(just)) == 2
    plain = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=2)))
    assert not any(r.logprobs for r in plain)


def _method(**kw):
    return pb.AttentionMethod(**kw)


INVALID = [
    ("empty input", pb.GenerateRequest(), "input"),
    ("empty text", pb.GenerateRequest(text=""), "text"),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids"),
    ("token id outside vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])), "token_ids[1]"),
    ("empty chat", pb.GenerateRequest(chat=pb.ChatMessages()), "chat"),
    ("bad role", pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="bot", content="x")])),
     "chat.messages[0].role"),
    ("negative temperature", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(temperature=-1)),
     "sampling.temperature"),
    ("top_p zero", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(top_p=0)), "sampling.top_p"),
    ("top_p above one", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(top_p=1.5)), "sampling.top_p"),
    ("negative top_k", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(top_k=-1)), "sampling.top_k"),
    ("min_p above one", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(min_p=2)), "sampling.min_p"),
    ("zero repetition penalty", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(repetition_penalty=0)),
     "sampling.repetition_penalty"),
    ("presence penalty range", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(presence_penalty=3)),
     "sampling.presence_penalty"),
    ("frequency penalty range", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(frequency_penalty=-3)),
     "sampling.frequency_penalty"),
    ("negative seed", pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(seed=-1)), "sampling.seed"),
    ("K zero", pb.GenerateRequest(text="a", method=_method(top_k=0)), "top_k"),
    ("K negative", pb.GenerateRequest(text="a", method=_method(name="exact_topk", top_k=-4)), "top_k"),
    ("R above C", pb.GenerateRequest(text="a", method=_method(recall=8, cache_size=4)), "recall"),
    ("tau above one", pb.GenerateRequest(text="a", method=_method(tau=1.5)), "tau"),
    ("negative T_r", pb.GenerateRequest(text="a", method=_method(refresh_every=-1)), "refresh_every"),
    ("unknown method", pb.GenerateRequest(text="a", method=_method(name="magic")), "method.name"),
    ("evaluation-only method", pb.GenerateRequest(text="a", method=_method(name="fidelity_probe")), "method.name"),
    ("unknown hyperparameter", pb.GenerateRequest(
        text="a", method=_method(name="full", params={"bogus": pb.ParamValue(int_value=1)})), "bogus"),
    ("param and field", pb.GenerateRequest(
        text="a", method=_method(top_k=4, params={"top_k": pb.ParamValue(int_value=4)})), "method.params"),
    ("param without value", pb.GenerateRequest(text="a", method=_method(params={"window": pb.ParamValue()})),
     "method.params"),
    ("method with session", pb.GenerateRequest(text="a", session_id="s", method=_method(name="full")), "method"),
    ("zero max_new_tokens", pb.GenerateRequest(text="a", max_new_tokens=0), "max_new_tokens"),
    ("max_new_tokens above limit", pb.GenerateRequest(text="a", max_new_tokens=10**6), "max_new_tokens"),
    ("empty stop string", pb.GenerateRequest(text="a", stop=["x", ""]), "stop[1]"),
    ("stop token outside vocab", pb.GenerateRequest(text="a", stop_token_ids=[10**6]), "stop_token_ids[0]"),
    ("empty request id", pb.GenerateRequest(text="a", request_id=""), "request_id"),
    ("empty session id", pb.GenerateRequest(text="a", session_id=""), "session_id"),
    ("session id with a blank and a path", pb.GenerateRequest(text="a", session_id="x y/../"), "session_id: must be"),
    ("session id too long", pb.GenerateRequest(text="a", session_id="s" * 129), "session_id: must be"),
    ("top_logprobs above the limit", pb.GenerateRequest(text="a", logprobs=True, top_logprobs=21), "top_logprobs"),
    ("top_logprobs without logprobs", pb.GenerateRequest(text="a", top_logprobs=2), "top_logprobs"),
    ("n above the limit", pb.GenerateRequest(text="a", n=17), "n: must lie in [1, 16]"),
    ("n with session", pb.GenerateRequest(text="a", n=2, session_id="s"), "n: must be 1 with session_id"),
    ("prompt too long", pb.GenerateRequest(text="x" * 101), "text: too long"),
]


@pytest.mark.parametrize("request_, field", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_generate_is_invalid_argument_naming_the_field(fake_server, request_, field):
    server = fake_server(max_prompt_tokens=100)
    code, details = code_of(lambda: server.stub.Generate(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details
    status = server.stub.GetServerStatus(pb.GetServerStatusRequest())
    assert (status.running, status.queued, status.ephemeral_sessions) == (0, 0, 0)  # nothing leaked
    assert server.runner.sessions == {}


def test_method_a_b_on_one_server(fake_server):
    server = fake_server()
    for method in (_method(name="full"), _method(name="exact_topk", top_k=4), _method(tau=0.5),
                   _method(name="streaming_llm", params={"sinks": pb.ParamValue(int_value=2)})):
        out = list(server.stub.Generate(pb.GenerateRequest(text="abc", max_new_tokens=3, method=method)))
        assert ids(out) == greedy_reference(enc("abc"), 3)


# --- sessions ----------------------------------------------------------------------------------------
def test_session_ids_have_a_charset_and_a_length(fake_server):
    server = fake_server()
    for bad in ("x y/../", "/etc", "-x", "a" * 129, "é", "a\nb"):
        code, details = code_of(lambda bad=bad: server.stub.CreateSession(pb.CreateSessionRequest(session_id=bad)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("session_id: must be 1-128 "), bad
    for good in ("chat-1.a:b@c_d", "0" * 128, "S"):
        assert server.stub.CreateSession(pb.CreateSessionRequest(session_id=good)).session_id == good


def test_sessions_over_grpc(fake_server):
    server = fake_server(max_sessions=2, key_share=1.0)  # the server-wide limit (no per-key share below it)
    stub = server.stub
    info = stub.CreateSession(pb.CreateSessionRequest(session_id="s", method=_method(tau=0.5)))
    assert info.session_id == "s" and info.method.name == "retopk" and abs(info.method.tau - 0.5) < 1e-6
    assert info.method.top_k == 8  # the server default's K kept, tau overridden
    generated = stub.CreateSession(pb.CreateSessionRequest()).session_id
    assert generated and generated != "s"
    assert code_of(lambda: stub.CreateSession(pb.CreateSessionRequest()))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(lambda: stub.CreateSession(pb.CreateSessionRequest(session_id="s")))[0] in (
        grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED)
    t1 = list(stub.Generate(pb.GenerateRequest(text="one ", session_id="s", max_new_tokens=3)))
    t2 = list(stub.Generate(pb.GenerateRequest(text="two ", session_id="s", max_new_tokens=3)))
    assert ids(t2) == greedy_reference(enc("one ") + ids(t1) + enc("two "), 3)
    assert t2[-1].session_id == "s" and stub.GetSession(pb.GetSessionRequest(session_id="s")).turns == 2
    listed = stub.ListSessions(pb.ListSessionsRequest()).sessions
    assert sorted(s.session_id for s in listed) == sorted(["s", generated])
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id="s")).session
    assert closed.num_tokens == 4 + 3 + 4 + 3
    for call in (lambda: stub.GetSession(pb.GetSessionRequest(session_id="s")),
                 lambda: stub.CloseSession(pb.CloseSessionRequest(session_id="s")),
                 lambda: stub.Generate(pb.GenerateRequest(text="x", session_id="s"))):
        code, details = code_of(call)
        assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    assert code_of(lambda: stub.GetSession(pb.GetSessionRequest()))[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_busy_session_is_failed_precondition(fake_server):
    server = fake_server(FakeRunner(step_delay_s=0.01))
    server.stub.CreateSession(pb.CreateSessionRequest(session_id="s"))
    first = server.stub.Generate(pb.GenerateRequest(text="a", session_id="s", max_new_tokens=1000))
    next(first)
    code, details = code_of(lambda: server.stub.Generate(pb.GenerateRequest(text="b", session_id="s")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "busy" in details
    first.cancel()


# --- load, cancel, deadline ----------------------------------------------------------------------------
def test_queue_full_is_resource_exhausted(fake_server):
    server = fake_server(FakeRunner(step_delay_s=0.01), max_running=1, max_queue=1, key_share=1.0)
    running = server.stub.Generate(pb.GenerateRequest(text="a", max_new_tokens=1000))
    next(running)  # admitted
    queued_out = []
    waiter = threading.Thread(target=lambda: queued_out.extend(
        server.stub.Generate(pb.GenerateRequest(text="b", max_new_tokens=2))))
    waiter.start()
    while server.stub.GetServerStatus(pb.GetServerStatusRequest()).queued < 1:
        pass
    code, details = code_of(lambda: server.stub.Generate(pb.GenerateRequest(text="c")))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in details
    running.cancel()
    waiter.join(30)
    assert ids(queued_out) == greedy_reference(enc("b"), 2)  # the queued request ran once the slot freed


def _wait_idle(stub):
    while True:
        status = stub.GetServerStatus(pb.GetServerStatusRequest())
        if (status.running, status.queued, status.ephemeral_sessions) == (0, 0, 0):
            return status


def test_cancel_and_deadline_free_the_slot(fake_server):
    server = fake_server(FakeRunner(step_delay_s=0.01), max_running=1)
    call = server.stub.Generate(pb.GenerateRequest(text="a", max_new_tokens=1000))
    next(call), next(call)
    call.cancel()
    _wait_idle(server.stub)
    code, _ = code_of(lambda: server.stub.Generate(pb.GenerateRequest(text="a", max_new_tokens=1000), timeout=0.3))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(server.stub)
    assert server.runner.sessions == {}
    out = list(server.stub.Generate(pb.GenerateRequest(text="ok", max_new_tokens=2)))  # the slot is usable
    assert ids(out) == greedy_reference(enc("ok"), 2)


# --- auth, tokenizer, model info, health, reflection -----------------------------------------------------
def test_api_key(fake_server):
    server = fake_server(api_key="sekret")
    request = pb.GenerateRequest(text="a", max_new_tokens=1)
    assert code_of(lambda: server.stub.Generate(request))[0] == grpc.StatusCode.UNAUTHENTICATED
    bad = (("authorization", "Bearer nope"),)
    assert code_of(lambda: server.stub.Generate(request, metadata=bad))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: server.stub.GetModelInfo(pb.GetModelInfoRequest()))[0] == grpc.StatusCode.UNAUTHENTICATED
    good = (("authorization", "Bearer sekret"),)
    assert len(list(server.stub.Generate(request, metadata=good))) == 1
    assert server.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good).name == "fake"
    health = health_pb2_grpc.HealthStub(server.channel)  # probes need no key
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_session_metadata_must_match_the_session_the_body_names(fake_server):
    """x-session-id (the routers' affinity key) is optional; when sent it must name the body's session."""
    stub = fake_server().stub
    key = lambda sid: (("x-session-id", sid),)  # noqa: E731
    assert stub.CreateSession(pb.CreateSessionRequest(session_id="a"), metadata=key("a")).session_id == "a"
    stub.CreateSession(pb.CreateSessionRequest(session_id="b"))  # no metadata: still accepted (direct clients)
    turn = pb.GenerateRequest(text="x", session_id="a", max_new_tokens=1)
    assert len(list(stub.Generate(turn, metadata=key("a")))) == 1
    assert stub.GetSession(pb.GetSessionRequest(session_id="a"), metadata=key("a")).turns == 1
    refused = [
        lambda: stub.CreateSession(pb.CreateSessionRequest(session_id="c"), metadata=key("a")),
        lambda: stub.CreateSession(pb.CreateSessionRequest(), metadata=key("c")),  # the server would pick another id
        lambda: stub.Generate(turn, metadata=key("b")),
        lambda: stub.Generate(pb.GenerateRequest(text="x", max_new_tokens=1), metadata=key("a")),
        lambda: stub.Generate(turn, metadata=(("x-session-id", "a"), ("x-session-id", "b"))),
        lambda: stub.GetSession(pb.GetSessionRequest(session_id="a"), metadata=key("b")),
        lambda: stub.CloseSession(pb.CloseSessionRequest(session_id="a"), metadata=key("b")),
    ]
    for call in refused:
        code, details = code_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("x-session-id:"), details
    assert sorted(s.session_id for s in stub.ListSessions(pb.ListSessionsRequest()).sessions) == ["a", "b"]
    assert stub.GetSession(pb.GetSessionRequest(session_id="a")).turns == 1  # the refused turn never ran
    assert stub.CloseSession(pb.CloseSessionRequest(session_id="a"), metadata=key("a")).session.session_id == "a"


def test_tokenize_detokenize_and_model_info(fake_server):
    server = fake_server()
    stub = server.stub
    tok = stub.Tokenize(pb.TokenizeRequest(text="hi"))
    assert list(tok.token_ids) == enc("hi") and list(tok.tokens) == ["h", "i"]
    assert list(stub.Tokenize(pb.TokenizeRequest(chat=USER)).token_ids) == enc("<user>hi\n<assistant>")
    assert stub.Detokenize(pb.DetokenizeRequest(token_ids=enc("ok") + [EOS], skip_special_tokens=True)).text == "ok"
    bad_ids = pb.DetokenizeRequest(token_ids=[1000])
    assert code_of(lambda: stub.Detokenize(bad_ids))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Tokenize(pb.TokenizeRequest()))[0] == grpc.StatusCode.INVALID_ARGUMENT
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_layers, info.num_heads, info.vocab_size, list(info.eos_token_ids)) == (2, 3, 128, [EOS])
    assert info.default_method.name == "retopk" and info.default_method.top_k == 8
    assert info.default_method.cache_size == 32 and info.default_method.params["retrieval"].string_value
    assert {"full", "exact_topk", "retopk"} <= set(info.methods) and "fidelity_probe" not in info.methods
    assert info.limits.max_new_tokens == 2000 and info.limits.max_prompt_tokens == info.max_context
    assert info.limits.max_top_logprobs == 20
    # the runner's defaults for unset sampling fields (the fake carries the chat fallback), every field resolved
    d = info.default_sampling
    assert (d.temperature, d.top_p, d.top_k, d.min_p) == (pytest.approx(0.7), pytest.approx(0.9), 0, 0)
    assert (d.repetition_penalty, d.presence_penalty, d.frequency_penalty) == (1, 0, 0) and not d.HasField("seed")
    assert info.default_sampling_source == server.runner.info.sampling_source != ""


def test_health_and_reflection(fake_server):
    server = fake_server()
    health = health_pb2_grpc.HealthStub(server.channel)
    for service in ("", "retopk.v1.ReTopKService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    answer = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in answer.list_services_response.service}
    assert {"retopk.v1.ReTopKService", "grpc.health.v1.Health"} <= names


def test_drain_finishes_running_streams_and_refuses_new_ones(fake_server):
    gate = threading.Event()  # decode steps wait for it: the stream stays in flight until the checks are done
    server = fake_server(FakeRunner(gate=gate))
    stream = server.stub.Generate(pb.GenerateRequest(text="a", max_new_tokens=60))
    first = next(stream)  # from prefill
    drained = threading.Thread(target=server.drain, args=(30.0,))
    drained.start()
    health = health_pb2_grpc.HealthStub(server.channel)
    readiness = health_pb2.HealthCheckRequest(service="retopk.v1.ReTopKService")  # liveness stays SERVING
    while health.Check(readiness).status != health_pb2.HealthCheckResponse.NOT_SERVING:
        pass
    code, _ = code_of(lambda: server.stub.Generate(pb.GenerateRequest(text="b")))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert drained.is_alive()  # waiting for the running stream
    gate.set()
    rest = list(stream)  # the running stream completes normally
    drained.join(30)
    assert ids([first, *rest]) == greedy_reference(enc("a"), 60)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH


# --- configuration -----------------------------------------------------------------------------------
def test_flags_override_env_override_defaults():
    config = config_from([], {})
    assert (config.port, config.metrics_port, config.model, config.method_params) == (50051, 9464, "smollm2-135m",
                                                                                       DEFAULT_METHOD_PARAMS)
    env = {"RETOPK_PORT": "6000", "RETOPK_MAX_QUEUE": "3", "RETOPK_METHOD": "exact_topk", "RETOPK_API_KEY": "k"}
    config = config_from(["--port", "7000"], env)
    assert (config.port, config.max_queue, config.method, config.method_params, config.api_key) == (
        7000, 3, "exact_topk", {}, "k")
    config = config_from(["--method-params", "top_k=32,tau=0.9,retrieval=recent", "--max-context", "none"], {})
    assert config.method_params == {"top_k": 32, "tau": 0.9, "retrieval": "recent"} and config.max_context is None


def test_rope_scaling_and_block_size_reach_the_runtime():
    config = config_from(["--rope-scaling", "linear:4", "--kv-block-size", "64"], {})
    runtime = config.runtime_config()
    assert runtime.rope_scaling == {"rope_type": "linear", "factor": 4.0} and runtime.kv_block_size == 64
    env = {"RETOPK_ROPE_SCALING": "rope_type=yarn,factor=2,original_max_position_embeddings=8192"}
    assert config_from([], env).rope_scaling == {"rope_type": "yarn", "factor": 2.0,
                                                 "original_max_position_embeddings": 8192}
    assert config_from([], {}).runtime_config().rope_scaling is None


@pytest.mark.parametrize("argv", [["--port", "70000"], ["--max-queue", "0"], ["--method", "magic"],
                                  ["--method", "fidelity_probe"], ["--method-params", "top_k=0"],
                                  ["--dtype", "float8"], ["--port", "x"],
                                  ["--rope-scaling", "dynamic:2"], ["--kv-block-size", "0"],
                                  ["--metrics-per-head", "maybe"], ["--session-idle-timeout-s", "0"]])
def test_bad_configuration_exits_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as info:
        config_from(argv, {})
    assert info.value.code == 2
    assert argv[0].lstrip("-").split("-")[0] in capsys.readouterr().err


def test_help_documents_every_option():
    from dataclasses import fields

    from retopk_server.cli import OPTIONS, build_parser
    from retopk_server.config import ServerConfig

    text = " ".join(build_parser().format_help().split())
    assert {o.field for o in OPTIONS} == {f.name for f in fields(ServerConfig)}  # one flag per config field
    for option in OPTIONS:
        assert option.flag in text and f"env {option.env};" in text


def test_metrics_per_head_flag_and_environment():
    assert config_from([], {}).metrics_per_head is True
    assert config_from(["--metrics-per-head", "false"], {}).metrics_per_head is False
    assert config_from([], {"RETOPK_METRICS_PER_HEAD": "0"}).metrics_per_head is False
    assert config_from(["--metrics-per-head", "yes"], {"RETOPK_METRICS_PER_HEAD": "off"}).metrics_per_head is True


def test_session_idle_timeout_reaches_the_engine():
    assert config_from([], {}).engine_config().session_idle_timeout_s == 3600.0
    assert config_from(["--session-idle-timeout-s", "none"], {}).engine_config().session_idle_timeout_s is None
    assert config_from([], {"RETOPK_SESSION_IDLE_TIMEOUT_S": "90"}).session_idle_timeout_s == 90.0


def test_wire_field_names_come_from_the_proto_and_the_config():
    from retopk_core.retopk_config import ReTopKConfig
    from retopk_server.runtime.sampling import SamplingParams
    from retopk_server.service.wire import NAMED_PARAMS, SAMPLING_FIELDS

    assert set(NAMED_PARAMS) <= set(ReTopKConfig.names())  # each named wire field is a ReTopKConfig field
    assert set(SAMPLING_FIELDS) == set(SamplingParams.__dataclass_fields__)


@pytest.mark.parametrize("method, field", [(_method(top_k=0), "method.top_k"), (_method(recall=8, cache_size=4),
                         "method.recall"), (_method(params={"bogus": pb.ParamValue(int_value=1)}),
                         "method.params['bogus']"), (_method(name="magic"), "method.name")])
def test_a_bad_method_names_its_field(method, field):
    from retopk_server.runtime.runtime_config import default_method_spec
    from retopk_server.service.wire import InvalidArgument, method_spec

    with pytest.raises(InvalidArgument) as info:
        method_spec(method, default_method_spec())
    assert info.value.field == field
