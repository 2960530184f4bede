"""Bounded inputs: every size and value a client chooses has a limit, and crossing it is INVALID_ARGUMENT
naming the field (never an allocation, never INTERNAL).

Method hyperparameters are checked against the model (runtime/method_limits.py): the fields that count
positions against max_context, the per-session state against 4x a full-context dense KV cache, which is
computed here independently from the state's definition (ReTopK: C x (4 d + 8 K) bytes per head and layer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math

import grpc
import pytest

from retopk_core.params import ParamError, check_context
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.config import ServerConfig
from retopk_server.runtime.method_limits import (
    check_method,
    check_server_method,
    dense_kv_bytes,
    method_state_bytes,
    state_cap_bytes,
)
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.runtime_config import default_method_spec
from retopk_server.runtime.sampling import MIN_TEMPERATURE, Sampler, SamplingParams
from retopk_server.service.limits import CHARS_PER_TOKEN, MAX_CHAT_MESSAGES, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS
from retopk_server.service.server import EXIT_USAGE, serve
from tests._live_server import free_port
from tests.server.conftest import FakeServer
from tests.server.fake_runner import FakeInfo, FakeRunner

pytestmark = pytest.mark.timeout(60)

SMOLLM2 = dataclasses.replace(FakeInfo(), num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context=8192)


def retopk_state_bytes(info, C: int, K: int) -> int:
    """ReTopK's FIFO per session: queries (C, d) float32 + supports (C, K) int64 + a float32 threshold and an
    int64 refresh period per head and layer, plus three int64 counters per layer."""
    return info.num_layers * (info.num_heads * (C * (4 * info.head_dim + 8 * K) + 4 + 8) + 3 * 8)


# --- method hyperparameters against the model ---------------------------------------------------------
@pytest.mark.parametrize("C, K", [(32, 512), (4, 64), (300, 512)])
def test_state_bytes_match_the_fifo_definition(C, K):
    spec = MethodSpec.of("retopk", cache_size=C, top_k=K)
    assert method_state_bytes(spec.build(), SMOLLM2) == retopk_state_bytes(SMOLLM2, C, K)


def test_dense_kv_bytes_and_cap():
    assert dense_kv_bytes(SMOLLM2) == 2 * 30 * 3 * 64 * 8192 * 4  # float32
    assert dense_kv_bytes(dataclasses.replace(SMOLLM2, dtype="bfloat16")) == 2 * 30 * 3 * 64 * 8192 * 2
    assert state_cap_bytes(SMOLLM2) == 4 * dense_kv_bytes(SMOLLM2)


@pytest.mark.parametrize("name, params, field", [
    ("retopk", {"cache_size": 1_000_000}, "cache_size"),  # the request that took 21.7 GB (issue #16)
    ("retopk", {"top_k": 8193}, "top_k"),
    ("retopk", {"window": 10**9}, "window"),
    ("retopk", {"refresh_every": 2**31 - 1}, "refresh_every"),
    ("retopk", {"dense_below": 8193}, "dense_below"),
    ("exact_topk", {"top_k": 2**62}, "top_k"),
    ("quest", {"top_k": 10**6, "page_size": 16}, "top_k"),
    ("streaming_llm", {"top_k": 10**7}, "top_k"),
    ("tokenselect", {"top_k": 9000}, "top_k"),
])
def test_position_counts_are_bounded_by_the_context(name, params, field):
    with pytest.raises(ParamError) as e:
        check_method(MethodSpec.of(name, **params), SMOLLM2)
    assert e.value.field == field and "8192" in str(e.value)


def test_state_beyond_the_cap_is_refused_naming_the_fields_that_size_it():
    # within the context, but C x K = 8192 x 8192: 139 GB of FIFO per session
    with pytest.raises(ParamError) as e:
        check_method(MethodSpec.of("retopk", cache_size=8192, top_k=8192), SMOLLM2)
    assert e.value.field == "top_k" and "cache_size" in str(e.value) and "MiB" in str(e.value)
    with pytest.raises(ParamError) as e:  # only cache_size set: it is the one named
        check_method(MethodSpec.of("retopk", cache_size=2048), SMOLLM2)
    assert e.value.field == "cache_size"
    biggest_ok = max(C for C in range(1, 8193) if retopk_state_bytes(SMOLLM2, C, 512) <= state_cap_bytes(SMOLLM2))
    check_method(MethodSpec.of("retopk", cache_size=biggest_ok), SMOLLM2)
    with pytest.raises(ParamError):
        check_method(MethodSpec.of("retopk", cache_size=biggest_ok + 1), SMOLLM2)


def test_the_defaults_and_the_edges_fit():
    for name in ("full", "exact_topk", "retopk", "quest", "sparq", "loki", "streaming_llm", "tokenselect"):
        check_method(MethodSpec.of(name), SMOLLM2)
    check_method(MethodSpec.of("retopk", top_k=8192, window=8192, refresh_every=8192, cache_size=2, recall=2),
                 SMOLLM2)


def test_the_servers_own_default_method_is_held_to_the_bounds():
    """--method-params get no pass for being the server's default (a request naming them does); the values the
    server ships pass the context bound as a method's declared defaults do."""
    operator = MethodSpec.of("retopk", window=9000)
    server = dataclasses.replace(SMOLLM2, default_method=operator)  # what the runner holds
    check_method(operator, server)
    with pytest.raises(ParamError) as e:
        check_server_method(operator, server)
    assert e.value.field == "window" and "<= 8192" in str(e.value)
    with pytest.raises(ParamError) as e:
        check_server_method(MethodSpec.of("retopk", cache_size=2048), server)
    assert e.value.field == "cache_size" and "MiB" in str(e.value)
    shipped = default_method_spec()
    assert dict(shipped.params)["dense_below"] == 1024
    check_server_method(shipped, dataclasses.replace(SMOLLM2, max_context=512))
    with pytest.raises(ParamError) as e:
        check_server_method(MethodSpec.of("retopk", dense_below=1000), dataclasses.replace(SMOLLM2, max_context=512))
    assert e.value.field == "dense_below"


def test_serve_refuses_method_params_past_the_models_bounds(caplog):
    config = ServerConfig(host="127.0.0.1", port=free_port(), metrics_port=0, method_params={"top_k": 5000})
    with caplog.at_level(logging.ERROR, logger="retopk_server"):
        code = asyncio.run(asyncio.wait_for(serve(config, runner_factory=FakeRunner), 30))
    assert code == EXIT_USAGE == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == ["--method-params: top_k must be <= 4096 (the model's context length), got 5000"]


def test_check_context_reads_the_declarations():
    from retopk_core.retopk_config import ReTopKConfig

    declared = {f.name for f in dataclasses.fields(ReTopKConfig) if f.metadata.get("context")}
    assert declared == {"top_k", "cache_size", "window", "refresh_every", "refresh_first", "dense_below"}
    check_context(ReTopKConfig(top_k=100), 100)
    with pytest.raises(ParamError):
        check_context(ReTopKConfig(top_k=101), 100)
    # defaults (K = 512, T_r = 128) and the server default's values pass at any context: they are not a caller's pick
    check_context(ReTopKConfig(), 100)
    check_context(ReTopKConfig(top_k=1024), 100, keep={"top_k": 1024})
    with pytest.raises(ParamError):
        check_context(ReTopKConfig(top_k=1025), 100, keep={"top_k": 1024})


# --- sampling values ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", math.inf), ("temperature", math.nan), ("temperature", -1e-38),
    ("top_p", math.nan), ("top_p", math.inf), ("min_p", math.nan),
    ("repetition_penalty", math.inf), ("repetition_penalty", 1e-38), ("repetition_penalty", 1e6),
    ("presence_penalty", -math.inf), ("frequency_penalty", math.nan),
])
def test_non_finite_or_overflowing_sampling_values_are_refused(field, value):
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, MIN_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(temperature):
    """Below MIN_TEMPERATURE sampling is the argmax (l / T would overflow float32); documented."""
    import torch

    logits = torch.tensor([1.0, 3.0, 2.9, -5.0])
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.greedy
    assert all(Sampler(params).sample(logits, [], []) == 1 for _ in range(20))


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1e-3, 3.0e38])
def test_small_and_huge_temperatures_sample_a_finite_distribution(temperature):
    import torch

    logits = torch.tensor([30.0, 29.0, -40.0, 0.0])
    params = SamplingParams(temperature=temperature, top_p=0.9, min_p=0.01, repetition_penalty=100.0, seed=3)
    sampler = Sampler(params)
    for _ in range(20):
        assert 0 <= sampler.sample(logits, [0, 2], [1]) < 4


# --- request sizes over gRPC (fake model: max_context 4096, --max-prompt-tokens 100) ----------------------
def code_of(call):
    try:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            list(result)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details()


@pytest.fixture(scope="module")
def server():
    server = FakeServer(FakeRunner(), max_prompt_tokens=100)
    yield server
    server.close()


def test_limits_are_reported_and_enforced(server):
    stub = server.stub
    limits = stub.GetModelInfo(pb.GetModelInfoRequest()).limits
    text_limit = CHARS_PER_TOKEN * 100
    assert (limits.max_text_chars, limits.max_chat_messages, limits.max_stop_strings, limits.max_stop_chars,
            limits.max_stop_token_ids, limits.max_detokenize_ids) == (
        text_limit, MAX_CHAT_MESSAGES, 16, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, 4096)
    assert limits.max_message_bytes >= 4 * text_limit and limits.max_method_state_bytes > 0
    cases = [
        (lambda: stub.Generate(pb.GenerateRequest(text="x" * (text_limit + 1))), "text"),
        (lambda: stub.Tokenize(pb.TokenizeRequest(text="x" * (text_limit + 1))), "text"),
        (lambda: stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 101))), "token_ids"),
        (lambda: stub.Generate(pb.GenerateRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="a")] * (MAX_CHAT_MESSAGES + 1)))), "chat.messages"),
        (lambda: stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="a" * (text_limit // 2))] * 3))), "chat.messages"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", stop=["y" * (MAX_STOP_CHARS + 1)])), "stop[0]"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", stop=["s"] * 17)), "stop"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))),
         "stop_token_ids"),
        (lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1] * 4097)), "token_ids"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", method=pb.AttentionMethod(cache_size=1_000_000))),
         "method.cache_size"),
        (lambda: stub.CreateSession(pb.CreateSessionRequest(method=pb.AttentionMethod(top_k=5000))), "method.top_k"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", method=pb.AttentionMethod(
            name="quest", params={"page_size": pb.ParamValue(int_value=2**62)}))), "method.params['page_size']"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(temperature=math.inf))),
         "sampling.temperature"),
        (lambda: stub.Generate(pb.GenerateRequest(text="a", sampling=pb.SamplingParameters(top_p=math.nan))),
         "sampling.top_p"),
    ]
    for call, field in cases:
        code, details = code_of(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field), (field, code, details)
    # just within the limits: served
    assert code_of(lambda: stub.Tokenize(pb.TokenizeRequest(text="x" * text_limit)))[0] == grpc.StatusCode.OK
    assert code_of(lambda: stub.Detokenize(pb.DetokenizeRequest(token_ids=[1] * 4096)))[0] == grpc.StatusCode.OK


def test_a_message_over_the_receive_limit_is_refused_by_grpc(server):
    limit = server.stub.GetModelInfo(pb.GetModelInfoRequest()).limits.max_message_bytes
    code, _ = code_of(lambda: server.stub.Tokenize(pb.TokenizeRequest(text="x" * (limit + 1))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_echoed_values_are_cut_so_the_status_fits_a_trailer(server):
    huge = "q" * 100_000
    for request, field in [
        (pb.GenerateRequest(text="a", method=pb.AttentionMethod(name=huge)), "method.name"),
        (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role=huge, content="x")])), "chat"),
        (pb.GenerateRequest(text="a", method=pb.AttentionMethod(
            params={huge: pb.ParamValue(int_value=1)})), "method.params"),
        (pb.GenerateRequest(text="a", method=pb.AttentionMethod(
            params={"retrieval": pb.ParamValue(string_value=huge)})), "method"),
    ]:
        code, details = code_of(lambda r=request: server.stub.Generate(r))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field) and len(details) <= 520
