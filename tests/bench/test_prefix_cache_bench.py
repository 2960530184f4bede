"""bench/prefix_cache.py's two workloads through a real engine on a tiny random Llama: with the cache the second
question and every stream after the first take the shared start from it, without it none does (no timing
asserted)."""

from __future__ import annotations

import pytest
import torch

from bench import prefix_cache as bench
from retopk_server.engine import Engine
from retopk_server.engine.requests import EngineConfig
from tests.server.fake_runner import FakeTokenizer
from tests.server.runtime.runtime_helpers import prompt_ids, runner_for, tiny_model


def encode(text: str) -> list[int]:
    return [ord(c) % 256 for c in text]


@pytest.mark.parametrize("cache", [False, True])
def test_both_workloads_report_the_cached_tokens(cache):
    torch.set_num_threads(1)
    runner = runner_for(tiny_model("llama", max_positions=1024), kv_block_size=4, prefill_chunk=4,
                        prefix_cache=cache)
    runner.tokenizer = FakeTokenizer()
    engine = Engine(lambda: runner, EngineConfig(max_running=4))
    engine.start()
    try:
        doc = bench.document_questions(engine, prompt_ids(40, seed=1), 2, encode)
        streams = bench.shared_system_prompt(engine, prompt_ids(24, seed=2), 3, 4, encode, salt="s")
    finally:
        engine.stop()
    assert len(doc) == 2 and all(r["first_s"] > 0 and r["second_s"] > 0 for r in doc)
    # the 40 document tokens and the questions' common start "\n\nQuestion: " (12): 13 full blocks shared
    assert [r["second_cached"] for r in doc] == ([52, 52] if cache else [0, 0])
    assert streams["generated"] == 12 and streams["tokens_per_s"] > 0
    # the first stream prefills the system prompt (24) and "\n\nUser " (7), the other two take the 7 full blocks
    assert streams["cached_tokens"] == (2 * 28 if cache else 0)
