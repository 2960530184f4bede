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

pytestmark = pytest.mark.timeout(600)


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


def test_fuzz_every_rpc(fuzz_server):
    result = fuzz(fuzz_server.address, FUZZ_REQUESTS, seed=16)
    assert result.total >= FUZZ_REQUESTS * 0.9
    assert not result.bad, "\n".join(f"{rpc} {code}: {details}\n  {req}" for rpc, code, details, req in result.bad)
    ok = sum(n for (_, code), n in result.counts.items() if code == "OK")
    assert ok >= FUZZ_REQUESTS * 0.1  # enough requests were valid to reach the engine and the model
    assert healthy(fuzz_server.address)
    assert fuzz_server.stop() == 0  # drains cleanly
