"""Fuzzing every rpc against a live server with the embedded model (tests/reliability/rpc_fuzz.py).

The default suite sends FUZZ_REQUESTS (200) generated requests; RETOPK_FUZZ_REQUESTS=10000 runs the
acceptance count (docs/reliability.md has its figures). No answer may be INTERNAL or UNKNOWN, and the
server must be healthy and drain cleanly afterwards.
"""

from __future__ import annotations

import os

import grpc
import pytest

pytest.importorskip("hypothesis")

from retopk_proto.retopk.v1 import retopk_pb2 as pb  # noqa: E402
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc  # noqa: E402
from tests._live_server import launch_server  # noqa: E402
from tests.reliability.rpc_fuzz import SERVER_ARGS, SERVICE, fuzz, healthy, message, requests  # noqa: E402

FUZZ_REQUESTS = int(os.environ.get("RETOPK_FUZZ_REQUESTS", "200"))

# a limit that grows with the request count: the acceptance count (make test-full) runs for many minutes
# (docs/reliability.md has its figures)
pytestmark = pytest.mark.timeout(600 + FUZZ_REQUESTS // 3)


@pytest.fixture(scope="module")
def fuzz_server():
    server = launch_server(*SERVER_ARGS, timeout=600)
    yield server
    server.kill()


def test_strategies_cover_every_rpc_and_field():
    """The generator reaches every rpc, and every field of every request type is set in some example."""
    from hypothesis import HealthCheck, given, settings

    seen_rpcs, seen_fields = set(), set()

    def fields_set(msg, prefix=""):
        for f, value in msg.ListFields():
            seen_fields.add(prefix + f.name)
            if f.message_type is not None and not f.message_type.GetOptions().map_entry:
                for item in (value if f.is_repeated else [value]):
                    fields_set(item, prefix + f.name + ".")

    @settings(max_examples=400, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def draw(case):
        rpc, request, _ = case
        seen_rpcs.add(rpc)
        fields_set(request, rpc + ".")

    draw()
    assert seen_rpcs == {m.name for m in SERVICE.methods}
    for m in SERVICE.methods:
        for f in m.input_type.fields:
            assert f"{m.name}.{f.name}" in seen_fields, f"{m.name}.{f.name} never set"
    assert message  # the per-message strategy is public for other tests


def test_the_issue_request_is_refused_cheaply(fuzz_server):
    """Issue #16: one Generate with cache_size 1000000 made the server allocate 21.7 GB and die."""
    with grpc.insecure_channel(fuzz_server.address) as channel:
        stub = pb_grpc.ReTopKServiceStub(channel)
        for method in (pb.AttentionMethod(name="retopk", cache_size=1_000_000),
                       pb.AttentionMethod(name="retopk", cache_size=2048, top_k=8192)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="hi", method=method)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "method." in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(temperature=1e-38,
                                                                                             top_p=float("nan")))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.top_p" in e.value.details()
        replies = list(stub.Generate(pb.GenerateRequest(text="The capital of France is", max_new_tokens=3,
                                                        sampling=pb.SamplingParameters(temperature=1e-38))))
        assert sum(len(r.token_ids) for r in replies) == 3  # tiny temperature: greedy, not INTERNAL


def test_wrong_types_in_every_field_are_refused_by_name(fuzz_server):
    """Wrong types over gRPC, both ways a client can send one (HTTP's: tests/server/http/test_raw_http.py):
    - a hyperparameter's ParamValue of another kind, for every hyperparameter of every method: INVALID_ARGUMENT
      naming it (method.top_k or method.params['sinks']);
    - a field's bytes in another wire type, for every scalar field of GenerateRequest and of its sampling and
      method messages: protobuf's parser keeps them as an unknown field, and the answer is never INTERNAL."""
    import dataclasses

    from retopk_core.methods.registry import method_class, serving_method_names
    from tests.reliability.rpc_fuzz import BAD_CODES

    values = {"int_value": 3, "float_value": 1.5, "string_value": "abc", "bool_value": True}
    takes = {"int": ("int_value",), "float": ("int_value", "float_value"), "bool": ("bool_value",),
             "str": ("string_value",)}
    refused = 0
    with grpc.insecure_channel(fuzz_server.address) as channel:
        stub = pb_grpc.ReTopKServiceStub(channel)
        for name in serving_method_names():
            config = method_class(name).config_class
            for f in dataclasses.fields(config) if config is not None else ():
                accepted = takes[str(f.type).split("|")[0].strip()]
                for kind in (k for k in values if k not in accepted):
                    method = pb.AttentionMethod(name=name, params={f.name: pb.ParamValue(**{kind: values[kind]})})
                    with pytest.raises(grpc.RpcError) as e:
                        list(stub.Generate(pb.GenerateRequest(text="hi", max_new_tokens=1, method=method), timeout=60))
                    details = e.value.details()
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, f.name, kind, details)
                    assert details.startswith((f"method.{f.name}: ", f"method.params['{f.name}']: ")), details
                    assert not details.split(": ", 1)[1].startswith(f.name + " "), details  # named once
                    refused += 1
        assert refused > 60
        raw = channel.unary_stream("/retopk.v1.ReTopKService/Generate", request_serializer=None,
                                   response_deserializer=pb.GenerateResponse.FromString)
        sent = 0
        for prefix, message in ((b"", pb.GenerateRequest.DESCRIPTOR),
                                (_tag(pb.GenerateRequest.DESCRIPTOR.fields_by_name["sampling"].number, 2),
                                 pb.SamplingParameters.DESCRIPTOR),
                                (_tag(pb.GenerateRequest.DESCRIPTOR.fields_by_name["method"].number, 2),
                                 pb.AttentionMethod.DESCRIPTOR)):
            for field in message.fields:
                if field.message_type is not None:
                    continue
                wrong = _wrong_wire(field)
                inner = wrong if not prefix else prefix + _varint(len(wrong)) + wrong
                body = pb.GenerateRequest(text="hi", max_new_tokens=1).SerializeToString() + inner
                try:
                    list(raw(body, timeout=60))
                    code = grpc.StatusCode.OK
                except grpc.RpcError as e:
                    code = e.code()
                assert code not in BAD_CODES, (message.name, field.name, code)
                sent += 1
        assert sent >= 20


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tag(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _wrong_wire(field) -> bytes:
    """The field's number with bytes of a wire type its declared type does not use."""
    from google.protobuf.descriptor import FieldDescriptor as FD

    if field.type in (FD.TYPE_STRING, FD.TYPE_BYTES):
        return _tag(field.number, 0) + _varint(7)  # a varint where text belongs
    if field.type in (FD.TYPE_FLOAT, FD.TYPE_FIXED32, FD.TYPE_SFIXED32):
        return _tag(field.number, 2) + _varint(3) + b"abc"  # text where 4 bytes belong
    return _tag(field.number, 5) + b"\x01\x02\x03\x04"  # 4 fixed bytes where a varint belongs


def test_fuzz_every_rpc(fuzz_server):
    result = fuzz(fuzz_server.address, FUZZ_REQUESTS, seed=16)
    assert result.total >= FUZZ_REQUESTS * 0.9
    assert not result.bad, "\n".join(f"{rpc} {code}: {details}\n  {req}" for rpc, code, details, req in result.bad)
    ok = sum(n for (_, code), n in result.counts.items() if code == "OK")
    assert ok >= FUZZ_REQUESTS * 0.1  # enough requests were valid to reach the engine and the model
    assert healthy(fuzz_server.address)
    assert fuzz_server.stop() == 0  # drains cleanly
