"""A tiny in-process ReTopKService whose failures are scripted, for the client's retry/timeout tests.

``FakeService.failures[rpc_name]`` is a list of status codes: each call of that rpc pops the first
and aborts with it while the list is non-empty. ``Generate`` streams ``tokens`` chunks; with
``fail_after_first`` set, it aborts with that code after the first chunk; a request with ``logprobs``
gets logprob -0.5 * (i + 1) on its i-th token. Every call's metadata is recorded in ``calls``, every
GenerateRequest in ``generate_requests``.
"""

from __future__ import annotations

import time
from concurrent import futures

import grpc

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc


class FakeService(pb_grpc.ReTopKServiceServicer):
    def __init__(self) -> None:
        self.failures: dict[str, list[grpc.StatusCode]] = {}
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.generate_requests: list[pb.GenerateRequest] = []
        self.tokens = ["Hello", ",", " world"]
        self.fail_after_first: grpc.StatusCode | None = None
        self.delay = 0.0

    def _enter(self, name: str, context) -> None:
        self.calls.append((name, dict(context.invocation_metadata())))
        if self.delay:
            time.sleep(self.delay)
        pending = self.failures.get(name)
        if pending:
            context.abort(pending.pop(0), f"scripted failure of {name}")

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def GetModelInfo(self, request, context):
        self._enter("GetModelInfo", context)
        return pb.ModelInfo(name="fake", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)

    def CreateSession(self, request, context):
        self._enter("CreateSession", context)
        return pb.SessionInfo(session_id=request.session_id or "s-1", method=request.method)

    def GetSession(self, request, context):
        self._enter("GetSession", context)
        return pb.SessionInfo(session_id=request.session_id)

    def CloseSession(self, request, context):
        self._enter("CloseSession", context)
        return pb.CloseSessionResponse(session=pb.SessionInfo(session_id=request.session_id))

    def Generate(self, request, context):
        self.generate_requests.append(request)
        self._enter("Generate", context)
        for i, text in enumerate(self.tokens):
            logprobs = [pb.TokenLogprob(token_id=i, logprob=-0.5 * (i + 1), token=text)] if request.logprobs else []
            yield pb.GenerateResponse(request_id=request.request_id or "fake", token_ids=[i], text=text,
                                      logprobs=logprobs)
            if i == 0 and self.fail_after_first is not None:
                context.abort(self.fail_after_first, "scripted failure mid-stream")
        yield pb.GenerateResponse(
            request_id=request.request_id or "fake", finish_reason=pb.FINISH_REASON_LENGTH,
            usage=pb.Usage(prompt_tokens=1, generated_tokens=len(self.tokens), session_tokens=1 + len(self.tokens)),
            timings=pb.Timings(total_seconds=0.01),
        )


class FakeServer:
    def __init__(self) -> None:
        self.service = FakeService()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_ReTopKServiceServicer_to_server(self.service, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)
