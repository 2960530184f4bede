"""The HTTP front driven by the official ``openai`` package, checked against the gRPC SDK on the same server.

References: the gRPC SDK's answer to the same greedy request (same engine, so the same tokens, token for
token: text, count, each token's string and logprob); for stop strings, that answer cut before the stop
string; for logprobs, the greedy rule (the sampled token is the most likely one) and the SDK's values.
Generations are few and short (the model runs on the CPU): the references are computed once per session.
"""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.server.http.conftest import KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
N = 5  # tokens per generation
TOP = 3


@pytest.fixture(scope="module")
def ref_completion(grpc_client):
    return grpc_client.complete(PROMPT, max_new_tokens=N, temperature=0, logprobs=True, top_logprobs=TOP)


@pytest.fixture(scope="module")
def ref_chat(grpc_client):
    return grpc_client.complete(messages=QUESTION, max_new_tokens=N, temperature=0, logprobs=True, top_logprobs=TOP)


def finish_of(ref) -> str:
    return "length" if ref.finish_reason.name in ("LENGTH", "CONTEXT_LENGTH") else "stop"


# ---------------------------------------------------------------------------------------------- models
def test_models_lists_the_served_model(openai_client, model):
    assert [m.id for m in openai_client.models.list().data] == [model]
    assert openai_client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


# ---------------------------------------------------------------------------------------------- completions
def test_completion_equals_grpc_token_for_token(openai_client, grpc_client, model, ref_completion):
    http = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=TOP)
    ref = ref_completion
    choice = http.choices[0]
    assert choice.text == ref.text and choice.finish_reason == finish_of(ref)
    assert http.usage.completion_tokens == len(ref.token_ids)
    assert http.usage.prompt_tokens == ref.usage.prompt_tokens
    assert choice.logprobs.tokens == [lp.token for lp in ref.logprobs]
    assert choice.logprobs.tokens == [grpc_client.detokenize([t]) for t in ref.token_ids]  # each id decoded alone
    assert choice.logprobs.token_logprobs == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-6)
    assert choice.logprobs.top_logprobs == [{t.token: pytest.approx(t.logprob, abs=1e-6) for t in lp.top}
                                            for lp in ref.logprobs]
    offsets, tokens = choice.logprobs.text_offset, choice.logprobs.tokens
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_completion_stream_and_token_id_prompt(openai_client, grpc_client, model, ref_completion):
    chunks = list(openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref_completion.text
    assert chunks[-1].choices[0].finish_reason == finish_of(ref_completion)
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    ids = grpc_client.tokenize(PROMPT).token_ids
    by_ids = openai_client.completions.create(model=model, prompt=[list(ids)], max_tokens=N, temperature=0)
    assert by_ids.choices[0].text == ref_completion.text


def test_stop_string_cuts_before_it(openai_client, model, ref_completion):
    words = ref_completion.text.split()
    assert len(words) >= 2, ref_completion.text
    stop = words[1]
    cut = openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0, stop=stop)
    assert cut.choices[0].text == ref_completion.text[:ref_completion.text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


# ---------------------------------------------------------------------------------------------- chat
def test_chat_equals_grpc_with_logprobs(openai_client, model, ref_chat):
    http = openai_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=N, temperature=0,
                                                 logprobs=True, top_logprobs=TOP)
    choice = http.choices[0]
    assert http.object == "chat.completion" and http.model == model
    assert choice.message.role == "assistant" and choice.message.content == ref_chat.text
    assert choice.finish_reason == finish_of(ref_chat)
    assert http.usage.completion_tokens == len(ref_chat.token_ids)
    assert http.usage.total_tokens == http.usage.prompt_tokens + http.usage.completion_tokens
    content = choice.logprobs.content
    assert [e.token for e in content] == [lp.token for lp in ref_chat.logprobs]
    assert [e.logprob for e in content] == pytest.approx([lp.logprob for lp in ref_chat.logprobs], abs=1e-6)
    for entry in content:
        assert len(entry.top_logprobs) == TOP and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.bytes == list(entry.token.encode())


def test_chat_stream_with_usage_and_logprobs(openai_client, model, ref_chat):
    chunks = list(openai_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=N, temperature=0,
                                                        stream=True, stream_options={"include_usage": True},
                                                        logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_chat.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [finish_of(ref_chat)]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref_chat.token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [lp.token for lp in ref_chat.logprobs]
    assert all(e.top_logprobs == [] for e in streamed)


def test_async_client_two_requests(async_openai, model, ref_chat):
    async def run():
        async with async_openai as client:  # one after the other: the server admits one, queues one (429 past)
            whole = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=N, temperature=0)
            stream = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=N,
                                                          temperature=0, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(run())
    assert whole == streamed == ref_chat.text


def test_seed_makes_sampling_repeatable(openai_client, model):
    texts = [openai_client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=1.0, seed=7)
             .choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


def test_retopk_method_and_session(openai_client, grpc_client, model):
    method = {"name": "exact_topk", "top_k": 8}
    http = openai_client.chat.completions.create(model=model, messages=QUESTION, max_tokens=N, temperature=0,
                                                 extra_body={"retopk": {"method": method}})
    assert http.choices[0].message.content == grpc_client.complete(messages=QUESTION, max_new_tokens=N,
                                                                   temperature=0, method=method).text
    with grpc_client.session() as session:
        for turn in (QUESTION, [{"role": "user", "content": "And of Italy?"}]):  # a session gets only new messages
            openai_client.chat.completions.create(model=model, messages=turn, max_tokens=2, temperature=0,
                                                  extra_body={"retopk": {"session_id": session.id}})
        assert session.refresh().turns == 2


# ---------------------------------------------------------------------------------------------- errors
def test_errors_are_openai_errors(openai_client, model):
    cases = [
        (openai.BadRequestError, "n", dict(n=17)),  # above ModelInfo.limits.max_n
        (openai.BadRequestError, "max_tokens", dict(max_tokens=10**9)),
        (openai.BadRequestError, "temperature", dict(temperature=-1)),
        (openai.BadRequestError, "top_logprobs", dict(logprobs=True, top_logprobs=1000)),
        (openai.BadRequestError, "retopk.method.top_k", dict(extra_body={"retopk": {"method": {"top_k": -3}}})),
        (openai.BadRequestError, "messages[0].role", dict(messages=[{"role": "robot", "content": "hi"}])),
        (openai.NotFoundError, "model", dict(model="gpt-17")),
        (openai.NotFoundError, "retopk.session_id", dict(extra_body={"retopk": {"session_id": "no-such-session"}})),
    ]
    for error, param, kwargs in cases:
        request = dict(model=model, messages=QUESTION, max_tokens=2) | kwargs
        with pytest.raises(error) as info:
            openai_client.chat.completions.create(**request)
        body = info.value.body
        assert body["message"] and body["type"], kwargs
        if param is not None:
            assert body["param"] == param and body["message"].startswith(param + ":"), (kwargs, body)


def test_wrong_key_is_401(http_server, model):
    for key in ("wrong-key", KEY + "x"):
        with openai.OpenAI(base_url=http_server.http_url + "/v1", api_key=key, max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
