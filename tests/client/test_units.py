"""Pieces of the client that need no server: errors, retry policy, requests, typed views, stats, addresses."""

from __future__ import annotations

import math
import random

import grpc
import pytest

from retopk_client import errors
from retopk_client._requests import generate_request, tokenize_request
from retopk_client.addresses import is_loopback
from retopk_client.cli.generate import summary
from retopk_client.loadgen import BenchConfig, BenchReport, RequestResult
from retopk_client.retry import RetryPolicy, call_with_retry
from retopk_client.stats import LatencySummary, percentile
from retopk_client.types import (
    Chunk,
    Completion,
    CompletionBuilder,
    FinishReason,
    Method,
    ModelInfo,
    Sampling,
    StepStats,
    TokenLogprob,
    TopLogprob,
    group_read_rate,
)
from retopk_proto.retopk.v1 import retopk_pb2 as pb


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "boom") -> None:
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


# ---- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, errors.NotFound),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
        (grpc.StatusCode.DEADLINE_EXCEEDED, errors.DeadlineExceeded),
        (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
        (grpc.StatusCode.UNAUTHENTICATED, errors.Unauthenticated),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExists),
        (grpc.StatusCode.CANCELLED, errors.Cancelled),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
    ],
)
def test_status_codes_map_to_typed_errors(code, cls):
    err = errors.from_rpc_error(FakeRpcError(code, "temperature must be >= 0"))
    assert type(err) is cls and isinstance(err, errors.RetopkError)
    assert err.code == code and err.message == "temperature must be >= 0"
    assert code.name in str(err) and "temperature" in str(err)


def test_code_without_subclass_is_a_plain_retopk_error():
    err = errors.from_rpc_error(FakeRpcError(grpc.StatusCode.DATA_LOSS))
    assert type(err) is errors.RetopkError and err.code == grpc.StatusCode.DATA_LOSS


# ---- retry -------------------------------------------------------------------------------------

def test_backoff_grows_geometrically_up_to_the_cap_within_the_jitter():
    policy = RetryPolicy(initial_backoff=0.1, multiplier=2.0, max_backoff=1.0, jitter=0.2)
    rng = random.Random(0)
    for attempt in range(8):
        base = min(1.0, 0.1 * 2.0**attempt)  # the definition, written out
        for _ in range(20):
            assert base * 0.8 - 1e-12 <= policy.backoff(attempt, rng) <= base * 1.2 + 1e-12
    exact = RetryPolicy(initial_backoff=0.5, multiplier=3.0, max_backoff=10.0, jitter=0.0)
    assert [exact.backoff(a) for a in range(4)] == [0.5, 1.5, 4.5, 10.0]


@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"initial_backoff": -1}, {"multiplier": 0.5},
                                    {"jitter": 1.0}, {"initial_backoff": 2.0, "max_backoff": 1.0}])
def test_retry_policy_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        RetryPolicy(**kwargs)


def _flaky(failures: list[grpc.StatusCode], result="ok"):
    calls = []

    def fn(timeout_left):
        calls.append(timeout_left)
        if len(calls) <= len(failures):
            raise FakeRpcError(failures[len(calls) - 1])
        return result

    return fn, calls


def test_unavailable_is_retried_with_the_policys_backoffs():
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.1, multiplier=2.0, max_backoff=5.0, jitter=0.0)
    fn, calls = _flaky([grpc.StatusCode.UNAVAILABLE] * 3)
    slept = []
    assert call_with_retry(fn, policy, timeout=None, sleep=slept.append) == "ok"
    assert len(calls) == 4 and slept == pytest.approx([0.1, 0.2, 0.4])


def test_retries_stop_after_max_attempts_with_the_typed_error():
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.0, jitter=0.0)
    fn, calls = _flaky([grpc.StatusCode.UNAVAILABLE] * 5)
    with pytest.raises(errors.Unavailable):
        call_with_retry(fn, policy, timeout=None, sleep=lambda s: None)
    assert len(calls) == 3


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.NOT_FOUND])
def test_other_codes_are_not_retried(code):
    fn, calls = _flaky([code])
    with pytest.raises(errors.RetopkError) as info:
        call_with_retry(fn, RetryPolicy(), timeout=None, sleep=lambda s: None)
    assert info.value.code == code and len(calls) == 1


def test_retries_never_outlive_the_deadline():
    policy = RetryPolicy(max_attempts=10, initial_backoff=5.0, max_backoff=5.0, jitter=0.0)
    fn, calls = _flaky([grpc.StatusCode.UNAVAILABLE] * 10)
    with pytest.raises(errors.Unavailable):
        call_with_retry(fn, policy, timeout=1.0, sleep=lambda s: pytest.fail("must not sleep past the deadline"))
    assert len(calls) == 1 and 0 < calls[0] <= 1.0


# ---- requests and typed views -------------------------------------------------------------------

def test_generate_request_maps_kwargs_onto_the_proto():
    req = generate_request(
        messages=[{"role": "user", "content": "hi"}, ("assistant", "yo")], session_id="s1", max_new_tokens=7,
        temperature=0.5, seed=3, method=Method.retopk(top_k=64, tau=0.9, sink=4), stop="END",
        return_step_stats=True, request_id="r1",
    )
    assert req.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in req.chat.messages] == [("user", "hi"), ("assistant", "yo")]
    assert req.session_id == "s1" and req.max_new_tokens == 7 and req.request_id == "r1"
    assert req.sampling.temperature == 0.5 and req.sampling.seed == 3
    assert not req.sampling.HasField("top_p")  # unset stays "server default"
    assert req.method.name == "retopk" and req.method.top_k == 64 and not req.method.HasField("window")
    assert req.method.params["sink"].int_value == 4
    assert list(req.stop) == ["END"] and req.return_step_stats


def test_generate_request_without_options_leaves_everything_to_the_server():
    req = generate_request("hello")
    assert req.text == "hello"
    for name in ("request_id", "session_id", "max_new_tokens", "sampling", "method"):
        assert not req.HasField(name), name


@pytest.mark.parametrize("kwargs", [{}, {"prompt": "a", "token_ids": [1]}, {"prompt": "a", "messages": []}])
def test_exactly_one_input_is_required(kwargs):
    with pytest.raises(TypeError, match="exactly one"):
        generate_request(**kwargs)


def test_unknown_sampling_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="temprature"):
        generate_request("x", temprature=0.5)


def test_tokenize_request_needs_one_input():
    assert tokenize_request("abc", None).text == "abc"
    with pytest.raises(TypeError):
        tokenize_request(None, None)


def test_method_round_trips_through_the_proto_with_typed_params():
    method = Method("quest", top_k=32, params={"page": 16, "ratio": 0.5, "mode": "max", "flag": True})
    back = Method.from_proto(pb.AttentionMethod.FromString(method.to_proto().SerializeToString()))
    assert back == method
    assert type(back.params["flag"]) is bool and type(back.params["page"]) is int


def test_method_coerce_accepts_names_and_mappings():
    assert Method.coerce("full") == Method("full")
    assert Method.coerce({"name": "retopk", "top_k": 8, "sink": 2}) == Method("retopk", top_k=8, params={"sink": 2})
    assert Method.coerce(None) is None


def test_final_chunk_carries_reason_usage_timings_and_path_counts():
    msg = pb.GenerateResponse(
        request_id="r", token_ids=[5], text="x", finish_reason=pb.FINISH_REASON_STOP_SEQUENCE,
        usage=pb.Usage(prompt_tokens=3, generated_tokens=1, session_tokens=4),
        timings=pb.Timings(total_seconds=1.5),
        step_stats=[pb.StepStats(token_index=0, num_layers=1, num_heads=3, path=[0, 0, 1])],
    )
    chunk = Chunk.from_proto(msg)
    assert chunk.is_final and chunk.finish_reason is FinishReason.STOP_SEQUENCE
    assert chunk.usage.session_tokens == 4 and chunk.timings.total_seconds == 1.5
    assert chunk.step_stats[0].path_counts() == {"reuse": 2, "fallback": 1}
    assert chunk.session_id is None
    middle = Chunk.from_proto(pb.GenerateResponse(request_id="r", token_ids=[1], text="a"))
    assert not middle.is_final and middle.usage is None and middle.timings is None


def test_logprobs_are_typed_per_token_and_gathered_with_their_mean():
    assert generate_request("x", logprobs=True, top_logprobs=3).top_logprobs == 3
    assert not generate_request("x").logprobs
    lp = pb.TokenLogprob(token_id=5, logprob=-0.5, token=" a", top=[pb.TopLogprob(token_id=5, logprob=-0.5, token=" a"),
                                                                    pb.TopLogprob(token_id=9, logprob=-1.5, token="b")])
    first = Chunk.from_proto(pb.GenerateResponse(request_id="r", token_ids=[5], text=" a", logprobs=[lp]))
    assert first.logprobs == (TokenLogprob(5, -0.5, " a", (TopLogprob(5, -0.5, " a"), TopLogprob(9, -1.5, "b"))),)
    builder = CompletionBuilder()
    builder.add(first)
    builder.add(Chunk.from_proto(pb.GenerateResponse(request_id="r", token_ids=[7], text="c",
                                                     logprobs=[pb.TokenLogprob(token_id=7, logprob=-1.0)])))
    done = builder.build()
    assert [x.token_id for x in done.logprobs] == [5, 7] and done.mean_logprob() == pytest.approx(-0.75)
    out = summary(done)
    assert out["mean_logprob"] == pytest.approx(-0.75) and out["logprobs"][0]["top"][1]["token"] == "b"
    plain = summary(Completion("", (), None, None, None, "r"))
    assert "logprobs" not in plain and "mean_logprob" not in plain  # only when asked for


def test_model_info_reports_the_default_sampling():
    msg = pb.ModelInfo(name="m", default_sampling=pb.SamplingParameters(temperature=0.2, top_p=0.9, top_k=0),
                       default_sampling_source="card", limits=pb.Limits(max_top_logprobs=20))
    info = ModelInfo.from_proto(msg)
    assert info.default_sampling == Sampling(temperature=0.2, top_p=0.9, top_k=0)  # float32 0.9 read back as 0.9
    assert info.default_sampling_source == "card" and info.limits.max_top_logprobs == 20


def test_group_read_rate_is_the_share_of_layer_group_step_triples_read():
    """Per step: true group_read entries / entries; over a completion: pooled over its steps (not a mean of
    per-step rates, which would weigh a step by nothing); None when the server sent no group reads."""
    def step(i: int, reads: tuple[bool, ...]) -> StepStats:
        return StepStats(i, 2, 4, (0,) * 8, (0.5,) * 8, (1,) * 8, 0.0, num_kv_heads=len(reads) // 2,
                         group_read=reads)

    a = step(1, (True, False, False, False))  # 2 layers x 2 groups, 1 read
    b = step(2, (True, True, False, True))  # 3 of 4 read
    c = step(3, (True, False))  # 2 layers x 1 group (one KV group a layer), 1 of 2 read
    assert a.group_read_rate() == 0.25 and b.group_read_rate() == 0.75 and c.group_read_rate() == 0.5
    assert group_read_rate([a, b, c]) == pytest.approx((1 + 3 + 1) / (4 + 4 + 2))
    completion = Completion("", (), None, None, None, "r", step_stats=(a, b, c))
    assert completion.group_read_rate() == pytest.approx(0.5)
    assert summary(completion)["group_read_rate"] == pytest.approx(0.5)
    assert StepStats(0, 1, 1, (0,), (0.5,), (1,), 0.0).group_read_rate() is None  # an older server
    assert Completion("", (), None, None, None, "r").group_read_rate() is None
    wire = pb.StepStats(num_layers=1, num_heads=3, num_kv_heads=1, path=[0, 7, 0], group_read=[True])
    assert StepStats.from_proto(wire).group_read_rate() == 1.0
    assert StepStats.from_proto(wire).path_counts() == {"reuse": 2, "promoted": 1}


def test_to_dict_is_json_ready():
    import json

    stats = StepStats(0, 1, 1, (0,), (math.nan,), (3,), 0.1)
    assert json.loads(json.dumps(stats.to_dict()))["max_sim"] == [None]
    info = ModelInfo.from_proto(pb.ModelInfo(name="m", num_layers=2, methods=["full"],
                                             default_method=pb.AttentionMethod(name="full")))
    data = json.loads(json.dumps(info.to_dict()))
    assert data["num_layers"] == 2 and data["default_method"]["name"] == "full" and data["methods"] == ["full"]


# ---- statistics and the load generator's report --------------------------------------------------

def _percentile_reference(values, q):
    """numpy's default ('linear') percentile, written from its definition."""
    xs = sorted(values)
    h = (len(xs) - 1) * q / 100
    lo = int(h)
    return xs[lo] if lo + 1 >= len(xs) else xs[lo] + (h - lo) * (xs[lo + 1] - xs[lo])


@pytest.mark.parametrize("n", [1, 2, 7, 100])
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_linear_interpolation(n, q):
    values = [random.Random(n).uniform(0, 10) for _ in range(n)]
    assert percentile(values, q) == pytest.approx(_percentile_reference(values, q))


def test_percentile_edges():
    assert math.isnan(percentile([], 50))
    assert percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_report_counts_tokens_errors_and_orders_percentiles():
    results = [
        RequestResult(ok=True, tokens=3, ttft=0.5, itl=[0.1, 0.2], e2e=0.8),
        RequestResult(ok=True, tokens=2, ttft=0.3, itl=[0.3], e2e=0.6),
        RequestResult(ok=False, error_code="RESOURCE_EXHAUSTED"),
        RequestResult(ok=False, error_code="RESOURCE_EXHAUSTED"),
        RequestResult(ok=False, error_code="UNAVAILABLE"),
    ]
    report = BenchReport.of(BenchConfig(concurrency=2, requests=5), results, wall=2.0)
    assert report.requests_sent == 5 and report.requests_ok == 2 and report.requests_failed == 3
    assert report.errors_by_code == {"RESOURCE_EXHAUSTED": 2, "UNAVAILABLE": 1}
    assert report.generated_tokens == 5 and report.tokens_per_second == 2.5
    assert report.ttft.count == 2 and report.ttft.p50_ms == pytest.approx(400.0)
    assert report.itl.count == 3 and report.itl.max_ms == pytest.approx(300.0)
    assert report.itl.p50_ms <= report.itl.p90_ms <= report.itl.p99_ms <= report.itl.max_ms
    table = report.format_table()
    assert "tokens/s" in table and "RESOURCE_EXHAUSTED: 2" in table and "p99" in table
    assert "sampling server defaults" in table and "logprobs" not in table
    assert report.to_dict()["ttft"]["count"] == 2 and report.mean_logprob is None


def test_empty_latency_summary_reports_nulls():
    assert LatencySummary.of([]).to_dict()["p50_ms"] is None


# ---- addresses -----------------------------------------------------------------------------------

@pytest.mark.parametrize("address", ["localhost:50051", "127.0.0.1:1", "127.5.5.5:9", "[::1]:50051",
                                     "ipv4:127.0.0.1:5,127.0.0.2:6", "unix:/tmp/retopk.sock"])
def test_loopback_addresses(address):
    assert is_loopback(address)


@pytest.mark.parametrize("address", ["10.0.0.1:50051", "8.8.8.8:443", "[2001:db8::1]:80",
                                     "ipv4:127.0.0.1:5,10.0.0.1:5", "no-such-host.invalid:1", ""])
def test_non_loopback_addresses(address):
    assert not is_loopback(address)


def test_bench_config_refuses_remote_targets_unless_allowed():
    with pytest.raises(ValueError, match="loopback"):
        BenchConfig(address="10.0.0.1:50051")
    assert BenchConfig(address="10.0.0.1:50051", allow_remote=True).address == "10.0.0.1:50051"
    with pytest.raises(ValueError, match="exactly one"):
        BenchConfig(duration=1.0, requests=3)


@pytest.mark.parametrize("argv", [["--address", "h:1", "--timeout", "5", "health"],
                                  ["health", "--address", "h:1", "--timeout", "5"],
                                  ["--address", "h:1", "health", "--timeout", "5"]])
def test_connection_options_go_before_or_after_the_subcommand(argv):
    from retopk_client.cli import build_parser

    args = build_parser({"RETOPK_API_KEY": "k"}).parse_args(argv)
    assert (args.command, args.address, args.timeout, args.api_key) == ("health", "h:1", 5.0, "k")
    args = build_parser({"RETOPK_ADDRESS": "env:2"}).parse_args(["health"])
    assert (args.address, args.timeout, args.api_key) == ("env:2", None, None)


def test_one_name_value_grammar():
    from retopk_shared.name_value import format_params, parse_params

    params = parse_params(" top_k=64, tau=0.9 ,retrieval=recent,reallocate=TRUE,")
    assert params == {"top_k": 64, "tau": 0.9, "retrieval": "recent", "reallocate": True}
    assert parse_params(format_params(params)) == params
    assert parse_params("tau=0.9+window=64", sep="+") == {"tau": 0.9, "window": 64}
    assert parse_params("") == {}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_params("top_k")


def test_named_method_fields_are_the_protos():
    from dataclasses import fields

    from retopk_client.types import RETOPK_FIELDS, SAMPLING_FIELDS, Sampling

    assert RETOPK_FIELDS == ("top_k", "cache_size", "window", "recall", "tau", "refresh_every")
    assert tuple(f.name for f in fields(Method) if f.name not in ("name", "params")) == RETOPK_FIELDS
    assert tuple(f.name for f in fields(Sampling)) == SAMPLING_FIELDS


@pytest.mark.parametrize("kwargs, field", [
    ({"method": {"name": "retopk", "top_k": "abc"}}, "method.top_k"),
    ({"method": Method("retopk", tau="hot")}, "method.tau"),
    ({"method": {"name": "retopk", "top_k": 1.5}}, "method.top_k"),
    ({"method": {"name": "retopk", "sink": [1]}}, "method.sink"),
    ({"method": {"name": 3}}, "method.name"),
    ({"temperature": "0.5"}, "sampling.temperature"),
    ({"top_k": 2 ** 40}, "sampling.top_k"),
    ({"seed": 2 ** 70}, "sampling.seed"),
    ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"stop": ["ok", 3]}, "stop[1]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"top_logprobs": "5"}, "top_logprobs"),
    ({"session_id": 7}, "session_id"),
])
def test_a_value_the_wire_cannot_hold_names_its_field(kwargs, field):
    """Not protobuf's bare TypeError ("'str' object cannot be interpreted as an integer"), which names nothing."""
    from retopk_client.types import FieldValueError

    with pytest.raises(FieldValueError) as e:
        generate_request("hi", **kwargs)
    assert e.value.field == field and str(e.value).startswith(f"{field}: must ")
    assert isinstance(e.value, TypeError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("argv, named", [
    (["generate", "--method-params", "top_k=abc", "hi"], "top_k"),
    (["generate", "--method-params", "tau=x", "hi"], "tau"),
    (["generate", "--max-new-tokens", "-5", "hi"], "max_new_tokens"),
    (["generate", "--seed", str(2 ** 70), "hi"], "seed"),
    (["sessions", "create", "--method-params", "window=1.5"], "window"),
])
def test_cli_bad_parameter_values_are_usage_errors(argv, named, capsys):
    """Exit 2 and one line naming the field, before anything is sent (the address is unreachable)."""
    from retopk_client.cli import EXIT_USAGE, main

    assert main(["--address", "127.0.0.1:9", "--timeout", "5", *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{named}: must " in err and err.startswith("usage: retopk")


def test_limits_are_every_field_of_the_protos():
    """The SDK's Limits is made from the proto's message: no limit the server reports can be missing."""
    from dataclasses import fields

    from retopk_client.cli.info import _limits
    from retopk_client.types import Limits

    names = [f.name for f in pb.Limits.DESCRIPTOR.fields]
    assert [f.name for f in fields(Limits)] == names
    assert {"max_message_bytes", "max_text_chars"} <= set(names)
    msg = pb.Limits(**{name: 1000 + i for i, name in enumerate(names)})
    limits = Limits.from_proto(msg)
    assert [getattr(limits, n) for n in names] == [1000 + i for i in range(len(names))]
    shown = " ".join(_limits(limits))
    assert all(f"{name} {1000 + i}" in shown for i, name in enumerate(names))
