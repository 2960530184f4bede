"""Bodies the openai package would never send, over raw httpx: every one gets a 4xx OpenAI error object
whose message names the field, never a 500; plus /health, unknown routes and the SSE wire format."""

from __future__ import annotations

import json
import signal
import socket
import time

import grpc
import pytest

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.http.app import body_bytes
from tests.server.http.conftest import KEY, TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

AUTH = {"Authorization": f"Bearer {KEY}"}


def post(raw, path: str, content: bytes | str, headers: dict | None = None):
    return raw.post(path, content=content, headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def chat_body(model: str, **fields) -> str:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields})


def test_health_needs_no_key(raw):
    response = raw.get("/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_malformed_bodies_are_400(raw, model):
    cases = {
        b"{not json": "body",
        b"": "body",
        b"[1, 2]": "body",
        b'{"model": "x", "messages": NaN}': "body",
        b"\xff\xfe\xfa": "body",
        b"[" * 100_000: "body",
        chat_body(model, temperature="hot").encode(): "temperature",
        chat_body(model, max_tokens=True).encode(): "max_tokens",
        chat_body(model, stop=5).encode(): "stop",
        chat_body(model, stream="yes").encode(): "stream",
        chat_body(model, frobnicate=1).encode(): "frobnicate",
        chat_body(model, retopk={"frobnicate": 1}).encode(): "retopk.frobnicate",
        chat_body(model, messages=[{"role": "user"}, {"content": "x"}]).encode(): "messages[1].role",
        chat_body(model, messages=[{"role": "user", "content": [{"type": "image_url"}]}]).encode():
            "messages[0].content[0]",
        chat_body(model, messages=[]).encode(): "messages",
        chat_body(model, seed=-1).encode(): "seed",
        chat_body(model, seed=2**70).encode(): "seed",
        chat_body(model, max_tokens=-5).encode(): "max_tokens",
        chat_body(model, retopk={"method": {"name": "nope"}}).encode(): "retopk.method.name",
        chat_body(model, retopk={"method": {"top_k": "many"}}).encode(): "retopk.method.top_k",
        json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode(): "model",
        chat_body(model, logit_bias={"42": 5}).encode(): "logit_bias",  # known to OpenAI, not implemented here
        chat_body(model, tools=[{"type": "function"}]).encode(): "tools[0]",
        chat_body(model, response_format={"type": "json_schema"}).encode(): "response_format.json_schema",
        chat_body(model, tool_choice={"type": "function"}).encode(): "tool_choice",
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}': "body",
    }
    for content, param in cases.items():
        error = error_of(post(raw, "/v1/chat/completions", content), 400)
        assert error["param"] == param, (content[:80], error)
        assert error["type"] == "invalid_request_error"


def _wrong_values(annotation) -> list:
    """JSON values of every type that ``annotation`` (a schema field's, strict) refuses."""
    from pydantic import TypeAdapter, ValidationError

    adapter = TypeAdapter(annotation)
    out = []
    for value in ("abc", "5", 1.5, 7, -5, 2**70, True, None, [1], [], {"a": 1}, {}):
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            out.append(value)
    return out


def _schema_cases(model: str):
    """(path, body, param) for a wrong-typed value in every field of both endpoints' schemas, of the nested
    objects (retopk, stream_options, a message) and of every method's hyperparameters in retopk.method."""
    import dataclasses
    import typing

    from retopk_core.methods.registry import method_class, serving_method_names
    from retopk_server.http.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, RetopkOptions

    base = {"/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            "/v1/completions": {"model": model, "prompt": "Hi", "max_tokens": 2}}
    schemas = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
    for path, schema in schemas.items():
        for name, f in schema.model_fields.items():
            for value in _wrong_values(f.annotation):
                yield path, {**base[path], name: value}, name
        for name, f in RetopkOptions.model_fields.items():
            for value in _wrong_values(f.annotation):
                yield path, {**base[path], "retopk": {name: value}}, f"retopk.{name}"
    chat = "/v1/chat/completions"
    for name, f in ChatMessage.model_fields.items():
        for value in _wrong_values(f.annotation):
            message = {"role": "user", "content": "Hi", name: value}
            yield chat, {**base[chat], "messages": [message]}, f"messages[0].{name}"
    kinds = {"int": int, "float": float, "bool": bool, "str": str}
    for method in serving_method_names():
        config = method_class(method).config_class
        for f in dataclasses.fields(config) if config is not None else ():
            kind = kinds.get(str(f.type).split("|")[0].strip(), typing.Any)
            wrong = [v for v in _wrong_values(kind) if v is not None and not (kind is float and type(v) is int)]
            for value in wrong:
                yield chat, {**base[chat], "retopk": {"method": {"name": method, f.name: value}}}, \
                    f"retopk.method.{f.name}"


def test_wrong_types_in_every_field_are_400_naming_it(raw, model):
    """Every field of the schemas (so a field added later is covered too) with a value of each JSON type it does
    not take: a 400 whose param names that field (or, for a value its field takes but a constraint refuses,
    still the field), never a 5xx."""
    seen = 0
    for path, body, param in _schema_cases(model):
        response = post(raw, path, json.dumps(body))
        assert response.status_code < 500, (path, body, response.text)
        error = error_of(response, 400)
        assert error["param"] is not None and error["param"].startswith(param.split("[")[0]), (body, error)
        if not error["param"].startswith("retopk.method"):
            assert error["param"] == param or error["param"].startswith((param + "[", param + ".")), (body, error)
        assert not error["message"].startswith(f"{param}: {param.rsplit('.', 1)[-1]} "), error  # said once
        seen += 1
    assert seen > 100


def test_ranges_are_worded_one_way_and_fields_named_once(http_server, raw, model):
    """max_tokens -5 (which the message's unsigned field cannot carry) and 0 read alike; no message repeats
    its field's name ("temperature: temperature must ...", "prompt: prompt too long")."""
    messages = {}
    for value in (-5, 0, 10**6):
        error = error_of(post(raw, "/v1/chat/completions", chat_body(model, max_tokens=value)), 400)
        messages[value] = error["message"]
    assert all(m.startswith("max_tokens: must lie in [1, ") and m.endswith(f"], got {v}") for v, m in messages.items())
    for field, value in (("logprobs", -1), ("logprobs", 10**6)):
        body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2, field: value})
        error = error_of(post(raw, "/v1/completions", body), 400)
        assert error["message"] == f"logprobs: must lie in [0, 20], got {value}", error
    for body, param in ((chat_body(model, temperature=-1), "temperature"),
                        (chat_body(model, retopk={"method": {"name": "retopk", "top_k": 0}}), "retopk.method.top_k"),
                        (json.dumps({"model": model, "prompt": "word " * 9000, "max_tokens": 2}), "prompt")):
        error = error_of(post(raw, "/v1/chat/completions" if "messages" in body else "/v1/completions", body), 400)
        name = param.rsplit(".", 1)[-1]
        assert error["param"] == param and not error["message"].startswith(f"{param}: {name} "), error


def test_not_found_session_names_its_field_and_models_need_the_header(raw, model):
    error = error_of(post(raw, "/v1/chat/completions", chat_body(model, retopk={"session_id": "no-such"})), 404)
    assert error["param"] == "retopk.session_id" and error["message"].startswith("retopk.session_id: "), error
    for path in ("/v1/models", f"/v1/models/{model}"):
        error = error_of(raw.get(path), 401)
        assert "header" in error["message"] and "metadata" not in error["message"], error


def test_a_body_longer_than_its_content_length_is_not_a_413(http_server):
    """Content-Length: 100 and a longer body: the server reads 100 bytes (HTTP/1.1 framing): whatever it answers,
    it is not 'payload too large' (the declared length is within the cap), and never a 5xx."""
    host, port = http_server.http_url.removeprefix("http://").split(":")
    body = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * 5000 + b'"}]}'
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < 200:
            part = sock.recv(65536)
            if not part:
                break
            answer += part
    status = int(answer.split(b" ")[1])
    assert status == 400 and b"payload_too_large" not in answer and b"resource_exhausted" not in answer, answer[:400]


def test_neutral_values_of_unimplemented_fields_are_accepted(raw, model):
    """What clients send by default for features this server lacks asks for nothing: it is accepted."""
    body = chat_body(model, logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"},
                     store=False, top_logprobs=0, n=1, user="someone", stream_options=None)
    assert post(raw, "/v1/chat/completions", body).status_code == 200
    body = json.dumps({"model": model, "prompt": "Hi", "max_tokens": 1, "echo": False, "best_of": 1, "suffix": None})
    assert post(raw, "/v1/completions", body).status_code == 200


def test_completion_prompt_shapes(raw, model):
    for prompt, param in [(["a", "b"], "prompt"), ([], "prompt"), ([1, "a"], "prompt"), ([-1], "prompt[0]"),
                          ([10**9], "prompt[0]"), ("", "prompt"), ({"a": 1}, "prompt")]:
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2})
        error = error_of(post(raw, "/v1/completions", body), 400)
        assert error["param"] == param, (prompt, error)


def test_oversized_body_is_413(http_server, raw, model):
    with grpc.insecure_channel(http_server.address) as channel:  # the gRPC front's receive limit
        info = pb_grpc.ReTopKServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=TIMEOUT,
                                                               metadata=[("authorization", f"Bearer {KEY}")])
    limit = body_bytes(info.limits.max_message_bytes)
    assert limit >= info.limits.max_message_bytes > 0
    big = chat_body(model, user="x" * limit).encode()
    error = error_of(post(raw, "/v1/chat/completions", big), 413)
    assert error["code"] == "resource_exhausted" and error["param"] == "body"  # the gRPC status, as documented
    chunks = iter([big[:1000], big[1000:]])  # no Content-Length: the cap holds while reading

    error_of(raw.post("/v1/chat/completions", content=chunks, headers=AUTH), 413)


def test_absurd_content_length_is_4xx(http_server):
    host, port = http_server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Length: {'9' * 5000}\r\n\r\n".encode())
        status = sock.recv(64).split(b" ")[1]
    assert status in (b"400", b"413")


def test_no_key_is_401(raw, model):
    response = raw.post("/v1/chat/completions", content=chat_body(model))
    error = error_of(response, 401)
    assert error["type"] == "authentication_error" and response.headers["www-authenticate"] == "Bearer"
    assert error_of(raw.post("/v1/chat/completions", content=b"{bad", headers={"Authorization": "Bearer no"}),
                    401)  # the key is checked before the body


def test_unknown_route_and_method(raw):
    error_of(raw.get("/v1/nothing", headers=AUTH), 404)
    error_of(raw.get("/v1/chat/completions", headers=AUTH), 405)


def test_sse_wire_format(raw, model):
    with raw.stream("POST", "/v1/chat/completions", headers=AUTH,
                    content=chat_body(model, stream=True, temperature=0)) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_streamed_error_before_first_token_is_a_status(raw, model):
    body = chat_body(model, stream=True, retopk={"session_id": "no-such-session"})
    error = error_of(post(raw, "/v1/chat/completions", body), 404)
    assert error["code"] == "not_found"


# ---------------------------------------------------------------------------------------------- load, drain
def open_stream(http_url: str, body: str) -> socket.socket:
    """A raw HTTP/1.1 POST /v1/completions left open (closing the socket is the client going away)."""
    host, port = http_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
    data = body.encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def cancelled_requests(raw, metrics_url: str) -> float:
    """retopk_request_errors_total{code="CANCELLED"}: requests the engine dropped because their caller left."""
    text = raw.get(metrics_url).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("retopk_request_errors_total{") and 'code="CANCELLED"' in line)


def test_full_queue_is_429_and_going_away_cancels(http_server, raw, grpc_client, model):
    before = cancelled_requests(raw, http_server.metrics_url)
    long = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
                       "retopk": {"ignore_eos": True}})
    running = open_stream(http_server.http_url, long)
    received = b""
    while b"data:" not in received:  # its first token: it is running
        received += running.recv(65536)
    assert received.startswith(b"HTTP/1.1 200")
    queued = open_stream(http_server.http_url, long)
    wait_for(lambda: grpc_client.server_status().queued == 1, "the second request to queue")
    error = error_of(post(raw, "/v1/completions", json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2})), 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted"
    queued.close()  # gone while queued: its wait is cancelled
    running.close()  # gone while streaming: the engine drops it at its next step
    wait_for(lambda: cancelled_requests(raw, http_server.metrics_url) == before + 2, "both to be cancelled")
    wait_for(lambda: (s := grpc_client.server_status()).running == 0 and s.queued == 0, "the engine to be idle")


def test_drain_finishes_the_stream_and_refuses_new_work(http_server, raw, model):
    """Last test of tests/server/http: SIGTERM drains the shared server."""
    body = json.dumps({"model": model, "prompt": "Once upon a time", "max_tokens": 64, "stream": True,
                       "retopk": {"ignore_eos": True}})
    with raw.stream("POST", "/v1/completions", headers=AUTH, content=body) as response:
        lines = (line for line in response.iter_lines() if line)
        assert next(lines).startswith("data: ") and next(lines).startswith("data: ")  # decoding in the batch
        http_server.process.send_signal(signal.SIGTERM)
        wait_for(lambda: raw.get("/health").status_code == 503, "/health to say draining")
        error = error_of(post(raw, "/v1/completions", json.dumps({"model": model, "prompt": "Hi"})), 503)
        assert error["type"] == "service_unavailable"
        events = list(lines)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"  # all 64 tokens
    assert http_server.process.wait(120) == 0
