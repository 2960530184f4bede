"""The model runtime: a Llama-family decoder with attention routed to the ReTopK core, sessions, sampling.

    runner = ModelRunner(RuntimeConfig())                      # the embedded SmolLM2-135M-Instruct
    session = runner.open_session(MethodSpec.of("retopk", top_k=64))
    logits = runner.prefill(session, runner.encode_chat([{"role": "user", "content": "Hi"}]))
    sampler = Sampler(SamplingParams(temperature=0.7, top_p=0.9, seed=1))
    token = sampler.sample(logits, [], session.token_ids)
    logits, stats = runner.decode([session], [token], with_stats=True)   # (1, vocab), StepStatsBatch

Files: runtime_config.py (RuntimeConfig), method_spec.py (MethodSpec), runner.py (ModelRunner, ModelInfo,
ContextTooLong), decoder/ (the forward over weights in their served format: linear.py, llama.py, load.py),
session.py, kv_pool.py (per-layer KV block pools), attention.py (each layer's attention: k/v into the pool,
dense prefill or the rows' methods, a batch grouped by method), sampling.py (SamplingParams, Sampler,
StopChecker), stats.py (StepStatsBatch, StepStats), memory.py (MemoryUsage), loading.py. ModelRunner is the engine's
``Runner`` (retopk_server/engine/runner_protocol.py).

Contexts longer than the model's trained positions are refused (ContextTooLong) unless
RuntimeConfig.rope_scaling is set, e.g. {"rope_type": "linear", "factor": 4.0} for 4x the positions.
"""

from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.runner import ContextTooLong, ModelInfo, ModelRunner
from retopk_server.runtime.runtime_config import RuntimeConfig
from retopk_server.runtime.sampling import Sampler, SamplingParams, StopChecker
from retopk_server.runtime.session import Session
from retopk_server.runtime.stats import StepStats, StepStatsBatch

__all__ = ["ContextTooLong", "MethodSpec", "ModelInfo", "ModelRunner", "RuntimeConfig", "Sampler", "SamplingParams",
           "Session", "StepStats", "StepStatsBatch", "StopChecker"]
