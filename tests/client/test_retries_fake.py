"""The SDK's retries, deadlines, streams and API key against a scripted in-process fake service."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from retopk_client import AsyncClient, Client, RetryPolicy, errors
from tests.client.fake_service import FakeServer

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
FAST = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.02, jitter=0.0)


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


@pytest.fixture
def client(fake):
    with Client(fake.address, retry=FAST, timeout=30, api_key="s3cret") as c:
        yield c


def test_idempotent_call_retries_unavailable_then_succeeds(fake, client):
    fake.service.failures["GetModelInfo"] = [UNAVAILABLE, UNAVAILABLE]
    assert client.model_info().name == "fake"
    assert fake.service.count("GetModelInfo") == 3


def test_idempotent_call_gives_up_after_max_attempts(fake, client):
    fake.service.failures["GetModelInfo"] = [UNAVAILABLE] * 5
    with pytest.raises(errors.Unavailable, match="scripted failure"):
        client.model_info()
    assert fake.service.count("GetModelInfo") == FAST.max_attempts


def test_non_retryable_code_fails_at_once(fake, client):
    fake.service.failures["GetModelInfo"] = [grpc.StatusCode.INVALID_ARGUMENT]
    with pytest.raises(errors.InvalidArgument):
        client.model_info()
    assert fake.service.count("GetModelInfo") == 1


def test_create_session_is_not_retried(fake, client):
    fake.service.failures["CreateSession"] = [UNAVAILABLE]
    with pytest.raises(errors.Unavailable):
        client.create_session("retopk")
    assert fake.service.count("CreateSession") == 1


def test_generate_is_retried_before_its_first_chunk(fake, client):
    fake.service.failures["Generate"] = [UNAVAILABLE]
    completion = client.complete("hi")
    assert completion.text == "Hello, world" and completion.token_ids == (0, 1, 2)
    assert completion.finish_reason.value == "length" and completion.usage.generated_tokens == 3
    assert fake.service.count("Generate") == 2


def test_generate_is_not_retried_once_streaming_started(fake, client):
    fake.service.fail_after_first = UNAVAILABLE
    stream = client.generate("hi")
    assert next(stream).text == "Hello"
    with pytest.raises(errors.Unavailable, match="mid-stream"):
        list(stream)
    assert fake.service.count("Generate") == 1


def test_api_key_travels_as_bearer_metadata(fake, client):
    client.model_info()
    with Client(fake.address) as anonymous:
        anonymous.model_info()
    (_, with_key), (_, without_key) = fake.service.calls
    assert with_key["authorization"] == "Bearer s3cret"
    assert "authorization" not in without_key


def test_per_call_timeout_raises_deadline_exceeded(fake, client):
    fake.service.delay = 1.0
    with pytest.raises(errors.DeadlineExceeded):
        client.model_info(timeout=0.2)


def test_session_context_manager_closes_the_session(fake, client):
    with client.session(method="full", session_id="abc") as s:
        assert s.id == "abc" and s.info.method.name == "full"
    assert [n for n, _ in fake.service.calls] == ["CreateSession", "CloseSession"]


def test_unreachable_server_is_unavailable_after_retries():
    with Client("127.0.0.1:1", retry=FAST, timeout=10) as c, pytest.raises(errors.Unavailable):
        c.model_info()


def test_async_client_retries_and_streams(fake):
    fake.service.failures["GetModelInfo"] = [UNAVAILABLE]
    fake.service.failures["Generate"] = [UNAVAILABLE]

    async def main():
        async with AsyncClient(fake.address, retry=FAST, timeout=30) as c:
            info = await c.model_info()
            texts = [chunk.text async for chunk in c.generate("hi")]
            async with c.session(method="retopk") as s:
                done = await s.complete("again")
            return info, texts, done

    info, texts, done = asyncio.run(main())
    assert info.num_heads == 4 and texts == ["Hello", ",", " world", ""] and done.text == "Hello, world"
    assert fake.service.count("GetModelInfo") == 2 and fake.service.count("Generate") == 3
    assert fake.service.count("CloseSession") == 1


def test_async_generate_not_retried_mid_stream(fake):
    fake.service.fail_after_first = UNAVAILABLE

    async def main():
        async with AsyncClient(fake.address, retry=FAST, timeout=30) as c:
            got = []
            with pytest.raises(errors.Unavailable):
                async for chunk in c.generate("hi"):
                    got.append(chunk.text)
            return got

    assert asyncio.run(main()) == ["Hello"]
    assert fake.service.count("Generate") == 1
