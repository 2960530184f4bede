"""A decode step's RoPE rows from the kept table (decoder/llama.py's RopeTable) against transformers' rotary embedding
called for those positions alone (``rope_tables``, what a step computed before): equal bit for bit at every
position of the model's context, as the table grows, for each fixed RoPE type; the dynamic types keep the call."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from retopk_server.runtime.decoder.llama import RopeTable, fixed_rope, rope_tables
from retopk_server.runtime.decoder.load import rotary_for
from retopk_server.runtime.loading import with_rope_scaling

# SmolLM2-135M's RoPE (head dim 64, theta 100000, 8K positions), plain and as the runtime scales it
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0},
            "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}


def _rotary(scaling: dict | None) -> torch.nn.Module:
    config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         max_position_embeddings=8192, rope_theta=100000.0)
    return rotary_for(with_rope_scaling(config, scaling))


@pytest.mark.parametrize("name", SCALINGS)
def test_table_rows_equal_the_embedding_of_each_position(name):
    """Every position 0 .. 8191 asked one at a time in rising order (a decode session's steps: the table grows by
    doubling from 256 rows), then batches of eight in random order: each row equals rope_tables' bit for bit."""
    rotary = _rotary(SCALINGS[name])
    assert fixed_rope(rotary)
    table, x = RopeTable(rotary), torch.zeros(1, 576)
    for p in range(8192):
        positions = torch.tensor([p])
        got = table.rows(x, positions, p)
        want = rope_tables(rotary, x, positions.view(1, 1))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape == (1, 64) and g.dtype == w.dtype == torch.float32
            assert torch.equal(g.view(torch.int32), w.view(torch.int32)), f"position {p}"
    assert table.cos.shape[0] == 8192  # 256 doubled five times
    generator = torch.Generator().manual_seed(0)
    x = torch.zeros(8, 576)
    for _ in range(64):
        positions = torch.randint(0, 8192, (8,), generator=generator)
        got, want = table.rows(x, positions, int(positions.max())), rope_tables(rotary, x, positions.view(8, 1))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g.view(torch.int32), w.view(torch.int32))


def test_dynamic_types_are_not_fixed():
    """transformers recomputes a dynamic RoPE's frequencies from the longest position: no table for it."""
    assert not fixed_rope(_rotary({"rope_type": "dynamic", "factor": 2.0}))
