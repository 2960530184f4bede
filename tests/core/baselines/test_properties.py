"""Properties every registered method must have, checked for all of them at once.

- budget: at most top_k positions attended per head and step, no duplicates;
- causal: only positions 0..L_b-1 are selected, and keys/values past each length (NaN here) never
  reach the output;
- with a budget >= L, the output equals full attention (torch SDPA per sequence);
- the bookkeeping has the documented shapes and types.
Shapes: GQA ratios 1 and 3, B = 3 with ragged lengths, contiguous and a shuffled multi-block pool,
float32 and bfloat16.
"""

from __future__ import annotations

import pytest
import torch

from retopk_core.methods import Path, make_method, method_names
from tests.core.baselines._harness import drive, make_run

# Small-scale hyperparameters per method; "{K}" is the token budget under test.
PARAMS = {
    "full": lambda K: {},
    "exact_topk": lambda K: dict(top_k=K),
    "retopk": lambda K: dict(top_k=K, cache_size=4, window=4, recall=2, refresh_every=3),
    "streaming_llm": lambda K: dict(top_k=K, sinks=3),
    "quest": lambda K: dict(top_k=K, page_size=4),
    "sparq": lambda K: dict(top_k=K, r=4),
    "loki": lambda K: dict(top_k=K, rank=4),
    "tokenselect": lambda K: dict(top_k=K, initial=3, local=4),
}


def build(name: str, K: int):
    if name in PARAMS:
        return make_method(name, **PARAMS[name](K))
    try:  # a method registered later: the shared budget keyword, else its defaults
        return make_method(name, top_k=K)
    except ValueError:
        return make_method(name)


# ((H, H_kv), block, dtype): GQA ratios 1 and 3 x contiguous / blocks of 4 tokens in a shuffled pool x
# float32 / bfloat16, every pair of values covered once (the full product adds time, not coverage).
VARIANTS = [
    pytest.param((4, 4), None, torch.float32, id="gqa1-contiguous-f32"),
    pytest.param((6, 2), 4, torch.float32, id="gqa3-paged-f32"),
    pytest.param((4, 4), 4, torch.bfloat16, id="gqa1-paged-bf16"),
    pytest.param((6, 2), None, torch.bfloat16, id="gqa3-contiguous-bf16"),
]


@pytest.mark.parametrize("shape, block, dtype", VARIANTS)
@pytest.mark.parametrize("name", method_names())
def test_budget_and_causality(name, shape, block, dtype):
    H, H_kv = shape
    K = 8
    method = build(name, K)
    run = make_run(H=H, H_kv=H_kv, prompt_lens=(37, 20, 6), steps=4, dtype=dtype, seed=1)
    for _, lengths, _q, out, _, _ in drive(method, run, block=block, poison=True):
        B = len(lengths)
        assert out.out.shape == (B, H, run.values.shape[-1]) and out.out.dtype == dtype
        assert torch.isfinite(out.out.float()).all(), "read past the current position (NaN poison reached output)"
        assert out.path.shape == (B, H) and out.path.dtype == torch.int8
        assert set(out.path.unique().tolist()) <= {int(p) for p in Path}
        assert out.n_scored.shape == (B, H)
        assert ((out.n_scored > 0) & (out.n_scored <= lengths.view(B, 1))).all()
        if out.n_approx is not None:
            assert out.n_approx.shape == (B, H) and (out.n_approx >= 0).all()
        if out.selected is None:  # dense attention: no selection, no budget
            assert name == "full"
            continue
        sel = out.selected
        valid = sel >= 0
        assert (valid.sum(-1) <= K).all(), "budget exceeded"
        assert (valid.sum(-1) >= 1).all()
        assert (sel < lengths.view(B, 1, 1)).all(), "selected a position past the current token"
        for b in range(B):
            for h in range(H):
                row = sel[b, h][valid[b, h]].tolist()
                assert len(row) == len(set(row)), "duplicate positions"


def sdpa_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Full attention of each sequence's query over its first L_b positions with torch SDPA, float32."""
    B, H, d = q.shape
    G = H // keys.shape[1]
    out = []
    for b in range(B):
        L = int(lengths[b])
        k = keys[b, :, :L].float().repeat_interleave(G, dim=0)  # (H, L, d)
        v = values[b, :, :L].float().repeat_interleave(G, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(q[b].float().unsqueeze(1), k, v)  # (H, 1, d)
        out.append(o.squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("shape, block, dtype", VARIANTS)
@pytest.mark.parametrize("name", method_names())
def test_budget_at_least_length_equals_full_attention(name, shape, block, dtype):
    H, H_kv = shape
    run = make_run(H=H, H_kv=H_kv, prompt_lens=(37, 20, 6), steps=4, dtype=dtype, seed=2)
    K = max(run.prompt_lens) + 8  # >= every length in the trace
    method = build(name, K)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for _, lengths, q, out, _, _ in drive(method, run, block=block, poison=True):
        ref = sdpa_reference(q, run.keys, run.values, lengths)
        torch.testing.assert_close(out.out.float(), ref, **tol)
        if out.selected is not None:
            counts = (out.selected >= 0).sum(-1)
            assert (counts == lengths.view(-1, 1)).all(), "a budget >= L must attend every position"


@pytest.mark.parametrize("name", [n for n in method_names() if n != "full"])
def test_describe_names_the_method_and_its_budget(name):
    d = build(name, 16).describe()
    assert d["method"] == name
    assert d.get("top_k") == 16


@pytest.mark.parametrize("name", ["streaming_llm", "quest", "sparq", "loki", "tokenselect"])
def test_bad_hyperparameters_raise_value_error_naming_the_field(name):
    with pytest.raises(ValueError, match="top_k"):
        make_method(name, top_k=0)
    with pytest.raises(ValueError, match="backend"):
        make_method(name, backend="cuda")


@pytest.mark.parametrize("name", ["streaming_llm", "quest", "sparq", "loki", "tokenselect"])
def test_triton_backend_runs_the_torch_code_and_says_so(name):
    # a server configured with backend="triton" passes it to every method; the baselines have no kernels
    assert make_method(name, backend="triton").describe()["backend"] == "torch"
