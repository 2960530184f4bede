"""SparQ against a per-head loop written from its definition: r largest |q_i|, approximate Top-K,
exact attention, and (optionally) mean-value reallocation."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.methods import make_method
from tests.core.baselines._harness import attend, check_against_reference, make_run


def reference_head(q, keys, values, r, K, scale, reallocate):
    """One head: (positions, output) from keys/values (L, d), in float64 with Python-level steps."""
    q, keys, values = q.double(), keys.double(), values.double()
    L, d = keys.shape
    comps = sorted(range(d), key=lambda i: abs(float(q[i])), reverse=True)[:r]
    approx = [sum(float(q[i]) * float(keys[j, i]) for i in comps) for j in range(L)]
    keep = sorted(sorted(range(L), key=lambda j: approx[j], reverse=True)[:K])
    y = attend(q, keys, values, keep, scale)
    if reallocate:
        l1 = sum(abs(float(q[i])) for i in comps) / float(q.abs().sum())
        w = torch.softmax(torch.tensor(approx, dtype=torch.float64) / math.sqrt(d * l1), dim=0)
        alpha = float(w[keep].sum())
        y = alpha * y + (1 - alpha) * values.mean(0)
    return keep, y


@pytest.mark.parametrize("r, K, H, H_kv, block, reallocate", [
    (2, 6, 4, 4, None, False),  # r = d/8
    (5, 10, 6, 2, 4, False),  # GQA 3, paged
    (2, 6, 6, 2, None, True),  # mean-value reallocation
    (16, 7, 4, 4, 3, True),  # r = d: exact Top-K selection
])
def test_matches_reference_loop(r, K, H, H_kv, block, reallocate):
    run = make_run(H=H, H_kv=H_kv, d=16, prompt_lens=(25, 12, 4), steps=3, seed=7)

    def reference(b, g, L, q, keys, values):
        return (*reference_head(q, keys, values, r, K, run.scale, reallocate), L)  # every key at r/d cost

    check_against_reference(make_method("sparq", top_k=K, r=r, reallocate=reallocate), run, block, reference)


def test_default_r_is_an_eighth_of_the_head_dim():
    method = make_method("sparq")
    assert method.config.components(128) == 16 and method.config.components(64) == 8
    assert method.describe()["reallocate"] is False


def test_r_must_be_positive():
    with pytest.raises(ValueError, match="r must"):
        make_method("sparq", r=0)
