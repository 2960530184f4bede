"""The SDK against ONE real retopk-server with the embedded SmolLM2-135M (see conftest.live_server).

Generations are kept few and short (a 2-core machine decodes a few tokens per second).
"""

from __future__ import annotations

import asyncio

import pytest

from retopk_client import AsyncClient, FinishReason, InvalidArgument, Method, NotFound, Sampling, errors
from tests._live_server import served_weight_format

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def paris_chunks(client):
    """The chunks of one greedy streamed answer to the question (shared by the tests below)."""
    return list(client.generate(messages=QUESTION, max_new_tokens=10, temperature=0.0))


def test_stream_names_paris_and_ends_with_a_report(client, paris_chunks):
    *body, final = paris_chunks
    assert len(body) >= 2, "tokens must arrive as a stream, not in one message"
    assert all(c.token_ids and c.finish_reason is None and c.usage is None for c in body)
    assert final.is_final and final.finish_reason in (FinishReason.EOS_TOKEN, FinishReason.LENGTH)
    token_ids = [t for c in paris_chunks for t in c.token_ids]
    text = "".join(c.text for c in paris_chunks)
    assert "Paris" in text
    assert final.usage.generated_tokens == len(token_ids)
    assert final.usage.session_tokens == final.usage.prompt_tokens + final.usage.generated_tokens
    # the server's tokenizer as the reference for the streamed text deltas
    assert text.strip() == client.detokenize(token_ids, skip_special_tokens=True).strip()
    assert final.usage.prompt_tokens == len(client.tokenize(messages=QUESTION).token_ids)
    t = final.timings
    assert 0 <= t.queue_seconds <= t.time_to_first_token_seconds <= t.total_seconds
    assert len({c.request_id for c in paris_chunks}) == 1 and final.session_id is None


def test_complete_gathers_the_same_greedy_answer(client, paris_chunks):
    done = client.complete(messages=QUESTION, max_new_tokens=10, request_id="complete-1", temperature=0.0)
    assert done.token_ids == tuple(t for c in paris_chunks for t in c.token_ids)
    assert done.text == "".join(c.text for c in paris_chunks)
    assert done.request_id == "complete-1" and done.finish_reason == paris_chunks[-1].finish_reason


def test_logprobs_arrive_typed_per_token(client, paris_chunks):
    done = client.complete(messages=QUESTION, max_new_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2)
    expected = tuple(t for c in paris_chunks for t in c.token_ids)[:3]
    assert done.token_ids == expected and tuple(lp.token_id for lp in done.logprobs) == expected
    for lp in done.logprobs:
        assert lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0].token_id == lp.token_id  # greedy: the best
        assert lp.top[0].logprob == pytest.approx(lp.logprob) and lp.top[0].logprob >= lp.top[1].logprob
    assert done.mean_logprob() == pytest.approx(sum(lp.logprob for lp in done.logprobs) / 3)
    assert done.logprobs[0].token == client.detokenize([expected[0]])


def test_session_continues_its_context_across_turns(client):
    """Two turns in a session equal one stateless request fed the whole history (greedy, full attention)."""
    first, second = client.tokenize("The sky is").token_ids, client.tokenize(" and the grass is").token_ids
    with client.session(method=Method.full()) as s:
        a = s.complete(token_ids=first, max_new_tokens=3, ignore_eos=True, temperature=0.0)
        b = s.complete(token_ids=second, max_new_tokens=3, ignore_eos=True, temperature=0.0)
        info = s.refresh()
        assert s.id in {x.session_id for x in client.list_sessions()}
    assert a.session_id == b.session_id == s.id
    assert b.usage.prompt_tokens == len(second)
    assert b.usage.session_tokens == a.usage.session_tokens + len(second) + 3
    assert info.turns == 2 and info.num_tokens == b.usage.session_tokens and info.method.name == "full"
    reference = client.complete(token_ids=first + a.token_ids + second, max_new_tokens=3, ignore_eos=True,
                                method="full", temperature=0.0)
    assert b.token_ids == reference.token_ids
    with pytest.raises(NotFound):  # the with block closed it
        client.get_session(s.id)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"method": Method.retopk(top_k=0)}, "top_k"),
        ({"method": "no_such_method"}, "method"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_invalid_arguments_raise_invalid_argument_naming_the_field(client, kwargs, field):
    with pytest.raises(InvalidArgument) as info:
        client.complete("Hello", **kwargs)
    assert field in info.value.message
    assert info.value.code.name == "INVALID_ARGUMENT"


def test_empty_prompt_is_invalid(client):
    with pytest.raises(InvalidArgument, match="text"):
        client.complete("")


def test_unknown_session_is_not_found(client):
    with pytest.raises(NotFound):
        client.get_session("no-such-session")
    with pytest.raises(NotFound):
        client.complete("Hello", session_id="no-such-session", max_new_tokens=1)
    with pytest.raises(errors.RetopkError) as info:
        client.close_session("no-such-session")
    assert isinstance(info.value, NotFound)


def test_model_info_health_status_and_tokenizer(client):
    info = client.model_info()
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.architecture == "LlamaForCausalLM" and info.max_context == 8192
    # the server's defaults on a CPU: the GGUF's Q4_1 matmuls as int4, its Q8_0 LM head as int8, a float16 KV cache
    assert (info.weight_format, info.kv_dtype, info.dtype) == (served_weight_format(), "float16", "float32")
    assert 90e6 < info.weight_bytes < 100e6  # ~98 MB of Q4_1 file, not the 538 MB of float32 matmuls
    assert {"full", "exact_topk", "retopk"} <= set(info.methods) and info.default_method.name in info.methods
    assert info.limits.max_new_tokens >= info.limits.default_max_new_tokens > 0
    assert info.limits.max_top_logprobs == 20
    assert info.default_sampling == Sampling(temperature=0.7, top_p=0.9, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                             presence_penalty=0.0, frequency_penalty=0.0)
    assert client.health() == "SERVING" and client.health("retopk.v1.ReTopKService") == "SERVING"
    status = client.server_status()
    assert status.running >= 0 and status.queued >= 0 and not status.draining
    tok = client.tokenize("Hello world")
    assert len(tok.token_ids) == len(tok.tokens) >= 2
    assert client.detokenize(tok.token_ids) == "Hello world"


def test_async_client_streams_and_keeps_a_session(live_server, paris_chunks):
    async def main():
        async with AsyncClient(live_server, timeout=300) as c:
            streamed = [chunk async for chunk in c.generate(messages=QUESTION, max_new_tokens=3, temperature=0.0,
                                                            logprobs=True)]
            async with c.session(method="full") as s:
                done = await s.complete("Hello", max_new_tokens=2, ignore_eos=True)
                listed = {x.session_id for x in await c.list_sessions()}
            try:
                await c.get_session(s.id)
                closed = False
            except NotFound:
                closed = True
            return streamed, done, s.id, listed, closed, await c.health()

    streamed, done, sid, listed, closed, health = asyncio.run(main())
    expected = [t for c in paris_chunks for t in c.token_ids][:3]
    assert [t for c in streamed for t in c.token_ids] == expected
    assert [lp.token_id for c in streamed for lp in c.logprobs] == expected
    assert streamed[-1].finish_reason is FinishReason.LENGTH
    assert done.usage.generated_tokens == 2 and done.session_id == sid
    assert sid in listed and closed and health == "SERVING"
