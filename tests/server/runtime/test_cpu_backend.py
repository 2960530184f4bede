"""How the runtime picks the fused CPU kernel (ReTopK, Full, Exact Top-K): backend "auto" (the default) on a
CPU device where it loaded, "cpu" explicitly; the tokens then equal those of the torch reference code."""

from __future__ import annotations

import pytest
from runtime_helpers import greedy, prompt_ids, runner_for, tiny_model

from retopk_core.cpu import launch
from retopk_core.methods.base import Path
from retopk_server.config import ServerConfig
from retopk_server.runtime import MethodSpec, RuntimeConfig


def test_method_backend_resolution():
    fused = "cpu" if launch.available() else "torch"
    assert ServerConfig().backend == RuntimeConfig().backend == "auto"
    assert RuntimeConfig().method_backend("retopk") == fused
    assert RuntimeConfig(device="cuda").method_backend("retopk") == "torch"
    for backend in ("torch", "triton"):
        assert RuntimeConfig(backend=backend).method_backend("retopk") == backend
    for method in ("full", "exact_topk"):  # the dense baselines have fused steps too
        assert RuntimeConfig().method_backend(method) == fused
        assert RuntimeConfig(backend="cpu").method_backend(method) == "cpu"
    for backend in ("auto", "cpu"):  # the other methods have no fused CPU kernel: their torch code
        assert RuntimeConfig(backend=backend).method_backend("quest") == "torch"
    assert RuntimeConfig(backend="cpu").method_backend("retopk") == "cpu"
    with pytest.raises(ValueError, match="backend"):
        RuntimeConfig(backend="cuda")


@pytest.mark.skipif(not launch.available(), reason="fused CPU kernel not built: run `python -m retopk_core.cpu.build`")
def test_fused_kernel_tokens_equal_the_torch_code():
    model = tiny_model("llama")
    prompt = prompt_ids(60, seed=4)
    spec = MethodSpec.of("retopk", top_k=8, cache_size=4, window=4, recall=2, tau=0.2, refresh_every=5,
                         gqa_policy="promote")
    outs, paths = {}, {}
    for backend in ("torch", "auto"):
        runner = runner_for(model, spec, backend=backend, kv_block_size=16)
        assert runner._groups[spec].method.backend == ("torch" if backend == "torch" else "cpu")
        assert runner.info.backend == runner._groups[spec].method.backend
        session = runner.open_session()
        tok = int(runner.prefill(session, prompt).argmax())
        outs[backend], paths[backend] = [tok], []
        for _ in range(12):
            logits, stats = runner.decode([session], [tok], with_stats=True)
            tok = int(logits[0].argmax())
            outs[backend].append(tok)
            paths[backend].append(stats[0].path.tolist())
    assert outs["auto"] == outs["torch"]
    assert paths["auto"] == paths["torch"]
    seen = {p for step in paths["auto"] for layer in step for p in layer}
    assert {Path.REUSE, Path.FALLBACK, Path.REFRESH, Path.PROMOTED} <= seen
    assert greedy(runner, runner.open_session(), prompt, 4) == outs["torch"][:4]
