"""The prefix cache over the OpenAI HTTP front of the live server (embedded model, default method): a second
prompt that starts with the first one's tokens (completions; a chat's first turn with the same system prompt)
reports the reused ones in usage.prompt_tokens_details, the Prometheus counters see them, and cache_salt
(vLLM's field) separates, bounded in length."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
import torch

from tests.server.http.conftest import KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def complete(raw, model: str, ids: list[int], **fields) -> dict:
    body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, **fields}
    response = raw.post("/v1/completions", content=json.dumps(body), headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def hit_tokens(http_server) -> float:
    text = httpx.get(http_server.metrics_url, timeout=30).text
    match = re.search(r'^retopk_prefix_cache_hit_tokens_total\{model="[^"]*"\} (\S+)$', text, re.M)
    return float(match.group(1))


def test_a_shared_start_is_reported_as_cached_tokens(http_server, raw, model):
    g = torch.Generator().manual_seed(30)
    document = torch.randint(100, 40000, (600,), generator=g).tolist()  # unlike any other test's prompt
    first = complete(raw, model, document + torch.randint(100, 40000, (100,), generator=g).tolist())
    assert first["prompt_tokens"] == 700 and first["prompt_tokens_details"] == {"cached_tokens": 0}
    before = hit_tokens(http_server)
    second_prompt = document + torch.randint(100, 40000, (100,), generator=g).tolist()
    assert complete(raw, model, second_prompt, cache_salt="other")["prompt_tokens_details"]["cached_tokens"] == 0
    # two blocks of 256 = one prefill chunk of 512; the default method's last 128 tokens are prefilled anyway
    assert complete(raw, model, second_prompt)["prompt_tokens_details"] == {"cached_tokens": 512}
    assert hit_tokens(http_server) == before + 512


def test_a_salt_past_its_limit_is_a_400_naming_it(raw, model):
    body = {"model": model, "prompt": "Hi", "max_tokens": 2, "cache_salt": "s" * 257}
    response = raw.post("/v1/completions", content=json.dumps(body), headers=AUTH)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "cache_salt" and "at most 256 characters" in error["message"]


def test_a_chats_first_turn_reuses_a_shared_system_prompt(raw, model):
    rng = random.Random(31)
    words = ["river", "stone", "lantern", "harbor", "meadow", "copper", "winter", "signal", "orchard", "thunder"]
    system = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(500))  # well over 640 tokens

    def chat(question: str) -> dict:
        body = {"model": model, "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
        response = raw.post("/v1/chat/completions", content=json.dumps(body), headers=AUTH)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    assert chat("Which word comes first?")["prompt_tokens_details"]["cached_tokens"] == 0
    usage = chat("Which word comes last?")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # whole prefill chunks of the system prompt, and never the prompt's last 128 tokens
    assert cached >= 512 and cached % 512 == 0 and cached <= usage["prompt_tokens"] - 128
