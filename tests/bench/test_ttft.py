"""bench/ttft.py on a tiny random Llama: one row per method, ratios against Full (no timing asserted)."""

import torch

from bench import ttft
from bench.e2e_cpu import parse_method
from retopk_server.runtime import ModelRunner, RuntimeConfig


def test_rows_per_method_with_ratio_to_full():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    specs = [parse_method(m) for m in ("full", "retopk:top_k=8,cache_size=4", "retopk:top_k=8,dense_below=64")]
    runner = ModelRunner(RuntimeConfig(model="tiny", default_method=specs[0]), model=model)
    rows = ttft.run(runner, specs, torch.randint(0, 128, (30,)).tolist(), rounds=3)
    assert [r["label"] for r in rows] == ["full", "retopk(cache_size=4,top_k=8)", "retopk(dense_below=64,top_k=8)"]
    assert all(r["prompt_tokens"] == 30 and r["ttft_ms"] >= r["min_ms"] > 0 for r in rows)
    assert rows[0]["vs_full"] == 1.0


def test_needs_a_timed_round():
    import pytest

    with pytest.raises(SystemExit, match="rounds"):
        ttft.main(["--rounds", "1"])
