"""Quantized and 16-bit weights and a 16-bit KV cache on the CPU; on a CUDA GPU (marker ``gpu``) the same
equalities with the torch and the Triton backends."""

from __future__ import annotations

import copy

import pytest
import torch
from runtime_helpers import greedy, prompt_ids, reference_greedy, runner_for, tiny_model

from retopk_server.runtime import MethodSpec, RuntimeConfig


def dequantized_twin(model, runner):
    """A copy of ``model`` whose matmul weights are the runner's decoder weights read back in float32 (each
    fused QKV / gate-up matrix split again): the float model that the quantized runner approximates."""
    twin = copy.deepcopy(model)
    for layer, weights in zip(twin.model.layers, runner.decoder.layers, strict=True):
        a, m = layer.self_attn, layer.mlp
        for mods, lin in (((a.q_proj, a.k_proj, a.v_proj), weights.qkv), ((a.o_proj,), weights.o),
                          ((m.gate_proj, m.up_proj), weights.gate_up), ((m.down_proj,), weights.down)):
            rows = lin.dequantized().split([mod.weight.shape[0] for mod in mods])
            for mod, w in zip(mods, rows, strict=True):
                mod.weight.data.copy_(w)
    twin.lm_head.weight.data.copy_(runner.decoder.lm_head.dequantized())
    return twin


def test_kv_dtype_auto_is_float16_on_a_cpu_and_bfloat16_on_cuda():
    """The KV cache's default, kv_dtype "auto", resolved for the device (a CPU's fused kernel reads float16 as fast
    as bfloat16 and keeps more of each value); a named dtype is that dtype on either device."""
    assert RuntimeConfig().kv_dtype == "auto" and RuntimeConfig().kv_torch_dtype == torch.float16
    for cuda in ("cuda", "cuda:1"):
        assert RuntimeConfig(device=cuda).kv_torch_dtype == torch.bfloat16
    for name in ("float32", "bfloat16", "float16"):
        for device in ("cpu", "cuda"):
            assert RuntimeConfig(device=device, kv_dtype=name).kv_torch_dtype == getattr(torch, name)


# A bfloat16 rounding moves an O(1) logit by up to eps / 2; a few of them through the layers move a gap
# between two log-probabilities by a few eps. Quantized weights with a bfloat16 KV cache may also run their
# prefill GEMMs through bfloat16 copies of the weights (decoder/linear.py's rule: not with int16 activations), a
# rounding of every weight too.
BF16 = torch.finfo(torch.bfloat16).eps
NEAR_TIE = {"16-bit": 4 * BF16, "16-bit prefill weights": 16 * BF16}


@pytest.mark.parametrize("weights,kv_dtype", [("bfloat16", "bfloat16"), ("float32", "bfloat16"),
                                              ("int8", "float32"), ("int4", "float32"), ("int4", "bfloat16")])
def test_quantized_and_16_bit_greedy_follows_generate_of_the_dequantized_model(arch, weights, kv_dtype):
    """Weights in a 16-bit or quantized format and a 16-bit KV cache, fed transformers' float32 greedy tokens
    of the model the runner's weights dequantize to: each of those tokens is the runner's argmax too, or,
    where rounding flipped a near-tie, its log-probability lies within NEAR_TIE of the argmax's. Quantized
    weights with a float32 KV cache compute in float32 throughout (the block kernels widen each weight
    exactly): every token is the argmax."""
    model = tiny_model(arch)
    prompt = prompt_ids(40, seed=1)
    runner = runner_for(model, weights=weights, kv_dtype=kv_dtype, prefill_chunk=16)
    assert runner.pool.k[0].dtype == getattr(torch, kv_dtype)
    assert runner.info.kv_dtype == kv_dtype and weights in runner.info.weight_format
    expected = reference_greedy(dequantized_twin(model, runner), prompt, 16)
    quantized = weights in ("int4", "int8")
    near_tie = NEAR_TIE["16-bit prefill weights" if quantized and kv_dtype == "bfloat16" else "16-bit"]
    session = runner.open_session()
    logits, exact = runner.prefill(session, prompt), 0
    for i, token in enumerate(expected):
        logp = torch.log_softmax(logits, dim=-1)
        assert logp[token] >= logp.max() - near_tie, (i, token, int(logp.argmax()), float(logp.max() - logp[token]))
        exact += int(logp.argmax()) == token
        logits = runner.decode([session], [token])[0][0]
    if quantized and kv_dtype == "float32":
        assert exact == len(expected)
    assert exact >= len(expected) - 2  # near-ties are rare: a flip at every step would be a bug, not rounding


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
