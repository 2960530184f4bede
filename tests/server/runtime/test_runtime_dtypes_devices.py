"""bfloat16 weights, KV cache and attention on the CPU; on a CUDA GPU (marker ``gpu``) the same
equalities with the torch and the Triton backends."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import greedy, prompt_ids, reference_greedy, runner_for, tiny_model

from retopk_server.runtime import MethodSpec


def test_bfloat16_greedy_equals_generate(arch):
    prompt = prompt_ids(40, seed=1)
    expected = reference_greedy(tiny_model(arch).to(torch.bfloat16), prompt, 16)
    runner = runner_for(tiny_model(arch), dtype="bfloat16", prefill_chunk=16)
    assert runner.pool.k[0].dtype == torch.bfloat16
    assert greedy(runner, runner.open_session(), prompt, 16) == expected


@pytest.mark.gpu
def test_cuda_full_greedy_equals_generate(arch):
    prompt = prompt_ids(70, seed=2)
    model = tiny_model(arch).cuda()
    ids = torch.tensor([prompt], device="cuda")
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                              pad_token_id=0)[0, len(prompt):].tolist()
    runner = runner_for(model, device="cuda", prefill_chunk=32, kv_block_size=16)
    assert greedy(runner, runner.open_session(), prompt, 20) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_method_equivalences(backend):
    model = tiny_model("llama")
    prompt = prompt_ids(90, seed=3)

    def run(spec):
        r = runner_for(model, spec, device="cuda", backend=backend, kv_block_size=16)
        return greedy(r, r.open_session(), prompt, 20)

    full = run(MethodSpec("full"))
    assert run(MethodSpec.of("exact_topk", top_k=128)) == full
    exact = run(MethodSpec.of("exact_topk", top_k=16))
    assert run(MethodSpec.of("retopk", top_k=16, cache_size=8, window=4, recall=2, tau=1.0)) == exact


@pytest.mark.slow
def test_triton_backend_reaches_the_methods():
    """backend="triton" is handed to every method (interpreted on a CPU): same tokens as the torch backend."""
    model = tiny_model("llama")
    prompt = prompt_ids(40, seed=3)
    spec = MethodSpec.of("retopk", top_k=16, cache_size=8, window=4, recall=2, tau=0.5)
    outs = {}
    for backend in ("torch", "triton"):
        runner = runner_for(model, spec, backend=backend, kv_block_size=16)
        assert runner._groups[spec].method.backend == backend
        outs[backend] = greedy(runner, runner.open_session(), prompt, 4)
    assert outs["triton"] == outs["torch"]
