"""Context limits: refused past the trained positions, extended by the documented RoPE scaling option."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import greedy, prompt_ids, reference_greedy, runner_for, tiny_model

from retopk_server.runtime import ContextTooLong, RuntimeConfig


def test_prefill_past_max_positions_is_refused_and_changes_nothing():
    runner = runner_for(tiny_model("llama", max_positions=64))
    assert runner.info.max_context == 64
    s = runner.open_session()
    with pytest.raises(ContextTooLong, match="64"):
        runner.prefill(s, prompt_ids(65, seed=0))
    assert s.length == 0 and s.blocks == []
    runner.prefill(s, prompt_ids(63, seed=0))
    runner.decode([s], [1])  # position 63, the last trained one
    with pytest.raises(ContextTooLong):
        runner.decode([s], [2])
    with pytest.raises(ContextTooLong):
        runner.prefill(s, [3])
    assert s.length == 64


def test_max_context_beyond_trained_positions_needs_rope_scaling():
    with pytest.raises(ValueError, match="rope_scaling"):
        runner_for(tiny_model("llama", max_positions=64), max_context=100)
    assert runner_for(tiny_model("llama", max_positions=64), max_context=40).info.max_context == 40


@pytest.mark.parametrize("bad", [{"rope_type": "linear"}, {"rope_type": "dynamic", "factor": 2.0},
                                 {"rope_type": "linear", "factor": 0.5}, "linear"])
def test_bad_rope_scaling_is_refused(bad):
    with pytest.raises(ValueError, match="rope_scaling"):
        RuntimeConfig(rope_scaling=bad)


def test_linear_rope_scaling_extends_the_context_like_transformers():
    """A prompt longer than the trained positions decodes as transformers' model built with the same
    RoPE parameters does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model("llama", max_positions=64)
    scaled_config = LlamaConfig(**{**model.config.to_dict(), "rope_parameters": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": model.config.rope_parameters["rope_theta"]}})
    reference = LlamaForCausalLM(scaled_config).eval()
    reference.load_state_dict(model.state_dict())
    prompt = prompt_ids(100, seed=4)
    expected = reference_greedy(reference, prompt, 12)

    runner = runner_for(model, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert runner.info.max_context == 128
    assert greedy(runner, runner.open_session(), prompt, 12) == expected


def test_sliding_window_models_are_limited_to_the_window():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                           sliding_window=48)
    runner = runner_for(MistralForCausalLM(config).eval())
    assert runner.info.max_context == 48
