"""The real `retopk-server` process with the embedded SmolLM2-135M, driven through raw gRPC stubs.

One shared server (fixture ``live_server``) serves most tests; the queue-full + SIGTERM test starts
its own small one. Generations are kept short (the model runs on the CPU). References: the model's
known greedy answer, the same request run alone (for batched runs), and the whole conversation sent
at once (for a session's later turn).
"""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from retopk_core.methods.base import Path
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from tests._live_server import launch_server
from tests.server.test_service import INVALID, code_of, ids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

QUESTION = pb.ChatMessage(role="user", content="What is the capital of France?")
ANSWER = "The capital of France is Paris."
# Tests that compare exact tokens ask for greedy decoding: an unset sampling field takes the model's defaults.
GREEDY = pb.SamplingParameters(temperature=0)


def chat(*messages: pb.ChatMessage) -> pb.ChatMessages:
    return pb.ChatMessages(messages=list(messages))


def text_of(responses) -> str:
    return "".join(r.text for r in responses)


def wait_idle(stub) -> pb.ServerStatus:
    """Poll until no request runs or waits (a freed slot shows up at the engine's next step)."""
    while True:
        status = stub.GetServerStatus(pb.GetServerStatusRequest())
        if (status.running, status.queued, status.ephemeral_sessions) == (0, 0, 0):
            return status


def test_health_reflection_and_model_info(live_server, live_stub):
    with grpc.insecure_channel(live_server) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "retopk.v1.ReTopKService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        answer = next(reflection.ServerReflectionInfo(iter([request])))
        services = {s.name for s in answer.list_services_response.service}
        assert {"retopk.v1.ReTopKService", "grpc.health.v1.Health",
                "grpc.reflection.v1alpha.ServerReflection"} <= services
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol="retopk.v1.ReTopKService")
        answer = next(reflection.ServerReflectionInfo(iter([request])))
        assert answer.file_descriptor_response.file_descriptor_proto  # grpcurl can describe it without the proto
    info = live_stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim, info.max_context) == (30, 9, 3, 64, 8192)
    assert info.name == "smollm2-135m" and info.architecture.startswith("Llama")
    assert info.default_method.name == "retopk" and info.default_method.top_k == 64
    # the embedded GGUF has no generation config: the chat defaults (runtime/sampling_defaults.py)
    assert (info.default_sampling.temperature, info.default_sampling.top_p) == (pytest.approx(0.7), pytest.approx(0.9))
    assert "chat defaults" in info.default_sampling_source and info.limits.max_top_logprobs == 20


def test_chat_answer_streams_token_by_token(live_stub):
    out = list(live_stub.Generate(pb.GenerateRequest(chat=chat(QUESTION), max_new_tokens=16, sampling=GREEDY)))
    assert text_of(out) == ANSWER
    assert out[-1].finish_reason == pb.FINISH_REASON_EOS_TOKEN
    assert len(out) == out[-1].usage.generated_tokens == len(ids(out))  # one message per token
    detok = live_stub.Detokenize(pb.DetokenizeRequest(token_ids=ids(out), skip_special_tokens=True))
    assert detok.text == ANSWER
    prompt = live_stub.Tokenize(pb.TokenizeRequest(chat=chat(QUESTION)))
    assert out[-1].usage.prompt_tokens == len(prompt.token_ids)


def test_concurrent_streams_are_batched_and_equal_each_request_alone(live_stub):
    prompts = [f"Write a short story about the number {i}." for i in range(8)]
    requests = [pb.GenerateRequest(text=p, max_new_tokens=4, ignore_eos=True, request_id=f"c{i}", sampling=GREEDY)
                for i, p in enumerate(prompts)]
    results: list = [None] * len(requests)
    peak = [0]
    done = threading.Event()

    def run(i):
        results[i] = list(live_stub.Generate(requests[i]))

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], live_stub.GetServerStatus(pb.GetServerStatusRequest()).running)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert peak[0] > 1  # several streams shared decode steps
    for request, batched in zip(requests, results, strict=True):
        alone = list(live_stub.Generate(request))
        assert ids(batched) == ids(alone) and len(ids(alone)) == 4
        assert all(r.request_id == request.request_id for r in batched)


def test_session_turn_equals_the_whole_conversation_sent_at_once(live_stub):
    session = live_stub.CreateSession(pb.CreateSessionRequest()).session_id
    try:
        turn1 = list(live_stub.Generate(pb.GenerateRequest(chat=chat(QUESTION), session_id=session,
                                                           max_new_tokens=16, sampling=GREEDY)))
        assert text_of(turn1) == ANSWER and turn1[-1].session_id == session
        follow_up = pb.ChatMessage(role="user", content="And of Germany?")
        turn2 = list(live_stub.Generate(pb.GenerateRequest(chat=chat(follow_up), session_id=session,
                                                           max_new_tokens=8, sampling=GREEDY)))
        info = live_stub.GetSession(pb.GetSessionRequest(session_id=session))
        assert info.turns == 2 and info.num_tokens == turn2[-1].usage.session_tokens
        assert info.kv_bytes > 0 and info.method_state_bytes > 0 and not info.busy
        assert turn2[-1].usage.prompt_tokens < 20  # only the new turn was fed, not the conversation
        assert session in {s.session_id for s in live_stub.ListSessions(pb.ListSessionsRequest()).sessions}
    finally:
        live_stub.CloseSession(pb.CloseSessionRequest(session_id=session))
    whole = chat(QUESTION, pb.ChatMessage(role="assistant", content=ANSWER), follow_up)
    reference = list(live_stub.Generate(pb.GenerateRequest(chat=whole, max_new_tokens=8, sampling=GREEDY)))
    assert ids(turn2) == ids(reference)
    code, _ = code_of(lambda: live_stub.GetSession(pb.GetSessionRequest(session_id=session)))
    assert code == grpc.StatusCode.NOT_FOUND


def test_step_stats_on_request(live_stub):
    out = list(live_stub.Generate(pb.GenerateRequest(text="Hello", max_new_tokens=3, ignore_eos=True,
                                                     return_step_stats=True, sampling=GREEDY)))
    stats = [s for r in out for s in r.step_stats]
    assert [s.token_index for s in stats] == [1, 2]
    for s in stats:
        assert (s.num_layers, s.num_heads) == (30, 9) and len(s.path) == len(s.n_scored) == len(s.max_sim) == 270
        assert set(s.path) == {Path.DENSE}  # the default ReTopK attends densely below its dense floor (1K)
        assert all(n > 0 for n in s.n_scored)
    plain = list(live_stub.Generate(pb.GenerateRequest(text="Hello", max_new_tokens=3, ignore_eos=True,
                                                       sampling=GREEDY)))
    assert not any(r.step_stats for r in plain) and ids(plain) == ids(out)


def test_methods_side_by_side(live_stub):
    """Full, Exact Top-K and ReTopK on one server: with K >= the context they attend to the same keys."""
    answers = set()
    for method in (pb.AttentionMethod(name="full"), pb.AttentionMethod(name="exact_topk", top_k=64),
                   pb.AttentionMethod(top_k=64, tau=0.9)):
        out = list(live_stub.Generate(pb.GenerateRequest(chat=chat(QUESTION), max_new_tokens=16, method=method,
                                                         sampling=GREEDY)))
        answers.add(text_of(out))
    assert answers == {ANSWER}


def test_logprobs_of_greedy_tokens_equal_the_models_log_softmax(live_stub, embedded_model):
    """The server's logprobs (default method: ReTopK, dense below its floor) against log_softmax of the logits
    of the model it serves (its default weight format and KV cache), run in this process over the prompt and
    the generated tokens: the rows predicting each generated token. (That the runtime's forward is the model's
    is tested against transformers' own in float32: tests/server/runtime.)"""
    import torch

    from retopk_server.runtime import ModelRunner, RuntimeConfig

    _, tokenizer = embedded_model
    out = list(live_stub.Generate(pb.GenerateRequest(chat=chat(QUESTION), max_new_tokens=4, sampling=GREEDY,
                                                     logprobs=True, top_logprobs=5)))
    generated, lps = ids(out), [lp for r in out for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == generated and len(generated) == 4
    prompt = list(live_stub.Tokenize(pb.TokenizeRequest(chat=chat(QUESTION))).token_ids)
    runner = ModelRunner(RuntimeConfig())  # the server's defaults
    session = runner.open_session()
    rows = [runner.prefill(session, prompt)] + [runner.decode([session], [t])[0][0] for t in generated[:-1]]
    ref = torch.log_softmax(torch.stack(rows), dim=-1)  # row i predicts generated[i]
    for i, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=2e-3)
        values, top_ids = torch.topk(ref[i], 5)
        assert [t.token_id for t in lp.top] == top_ids.tolist() and lp.top[0].token_id == lp.token_id
        assert [t.logprob for t in lp.top] == pytest.approx(values.tolist(), abs=2e-3)
        assert lp.token == tokenizer.decode([lp.token_id])


def test_cancel_and_deadline_free_the_slot(live_stub):
    call = live_stub.Generate(pb.GenerateRequest(text="Count to one hundred:", max_new_tokens=500, ignore_eos=True))
    next(call)
    call.cancel()
    wait_idle(live_stub)
    code, _ = code_of(lambda: live_stub.Generate(
        pb.GenerateRequest(text="Count to one hundred:", max_new_tokens=500, ignore_eos=True), timeout=1.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(live_stub)


CHEAP_INVALID = [c for c in INVALID if c[0] != "prompt too long"]


@pytest.mark.parametrize("request_, field", [c[1:] for c in CHEAP_INVALID], ids=[c[0] for c in CHEAP_INVALID])
def test_invalid_requests(live_stub, request_, field):
    code, details = code_of(lambda: live_stub.Generate(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, details


def test_prompt_too_long_and_unknown_session(live_stub):
    # one id past the model's 8192 positions: the input bound (service/limits.py) refuses it before any work
    code, details = code_of(lambda: live_stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * 8193))))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("token_ids: at most 8192"), details
    code, details = code_of(lambda: live_stub.Generate(pb.GenerateRequest(text="hi", session_id="no-such")))
    assert code == grpc.StatusCode.NOT_FOUND and "session_id" in details
    assert wait_idle(live_stub).ephemeral_sessions == 0


def test_queue_full_then_sigterm_drain():
    server = launch_server("--max-running", "1", "--max-queue", "1", "--drain-grace-s", "300", "--key-share", "1")
    try:
        channel = grpc.insecure_channel(server.address)
        stub = pb_grpc.ReTopKServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        running = stub.Generate(pb.GenerateRequest(text="Once upon a time", max_new_tokens=24, ignore_eos=True))
        first = next(running)
        queued: list = []
        waiter = threading.Thread(target=lambda: queued.extend(
            stub.Generate(pb.GenerateRequest(text="Hi", max_new_tokens=2, ignore_eos=True))))
        waiter.start()
        while stub.GetServerStatus(pb.GetServerStatusRequest()).queued < 1:
            pass
        code, details = code_of(lambda: stub.Generate(pb.GenerateRequest(text="more")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in details

        server.process.terminate()  # SIGTERM
        readiness = health_pb2.HealthCheckRequest(service="retopk.v1.ReTopKService")  # liveness stays SERVING
        while health.Check(readiness).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            pass
        code, _ = code_of(lambda: stub.Generate(pb.GenerateRequest(text="late")))
        assert code == grpc.StatusCode.UNAVAILABLE
        rest = list(running)  # accepted work finishes within the grace period
        waiter.join(300)
        assert len(ids([first, *rest])) == 24 and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(ids(queued)) == 2 and queued[-1].finish_reason == pb.FINISH_REASON_LENGTH
        channel.close()
        assert server.process.wait(120) == 0
        assert "draining" in server.output()
    finally:
        server.kill()


def test_startup_log_names_each_phase_and_when_the_model_is_ready(live_server_process):
    """A start says what it is doing between "loading model" and "ready": the GGUF's config and tokenizer
    (converted once, then read from the cache), its weights in the served format, and the load's time."""
    import re

    log = live_server_process.output()
    phases = ["loading model smollm2-135m on cpu (weights auto, KV cache auto",
              "reading SmolLM2-135M-Instruct.Q4_1.gguf: config and tokenizer",
              "reading SmolLM2-135M-Instruct.Q4_1.gguf: weights (as-stored)",
              "model loaded in", "model ready in", "listening on"]
    at = [log.find(p) for p in phases]
    assert all(i >= 0 for i in at) and at == sorted(at), log
    assert re.search(r"model loaded in [0-9.]+ s: int4, lm_head int8 weights, 96\.6 MB read per decode step", log)
