"""Configuration of the model runtime: which model, where it runs, the default method, context limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from retopk_core.models import DEFAULT_MODEL
from retopk_core.params import check_int, check_number
from retopk_server.runtime.budget import DEFAULT_CACHE_FRACTION
from retopk_server.runtime.method_spec import MethodSpec

WEIGHTS = ("auto", "as-stored", "float32", "bfloat16", "float16", "int8", "int4")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16")
# retopk_core.cpu.decoder_ops.ACTIVATIONS, which the block products take
ACTIVATIONS = ("float32", "int8", "bf16x2", "int16")
ACTIVATION_CHOICES = ("auto", *ACTIVATIONS)  # "auto": resolved at load (Decoder.auto_activations)
BACKENDS = ("auto", "torch", "triton", "cpu")
FUSED_CPU = ("retopk", "full", "exact_topk")  # methods with a step in retopk_core/cpu
# "dynamic" is left out: it rescales by the longest row of a batch, which would couple batched sessions.
ROPE_TYPES = ("linear", "yarn", "longrope", "llama3")


# The default method of a server, sized for the embedded 8K-position model and chosen by measurement; the
# figures behind each choice are in docs/evaluation.md ("Quality across corpora", "GQA policies", "Per-head
# thresholds calibrated online") and BENCHMARKS.md. K = 64 rather than the paper's 512 (the paper sizes K for
# 32K-128K contexts; 64 keeps a similar support ratio at 4K-8K); the paper's per-head rule at tau = 0.85 with a
# 128-entry FIFO and a 128-token window (the per-KV-group rules that read fewer groups lost deep needles); each
# head's threshold calibrated online towards a would-be reuse recall of 0.75, a refresh every 32 steps, and the
# online guard (tau_guard 0.5) that raises a head's threshold where an exact step shows reuse would have missed;
# dense attention below 1K tokens. Issue 35 cross-validated it over four corpora (tuned on the technical
# documentation and the modern prose, held out on the source code and the KJV): ΔPPL <= 1% against Exact Top-K
# and group reads <= 25% at 4K and 8K on all four, where r* = 0.8 alone (the previous default, tuned on the KJV)
# missed three of those eight points. recall_successors (A_t also holds p + 1 of each recalled position) lets a
# copying head follow the text it copies, which reuse alone misses (needles copied with a digit dropped); it
# also recalls more of the exact supports, so fewer heads fall back (docs/evaluation.md, issue 35).
# refresh_first 8 (each turn's first 8 decode steps refresh every head): the FIFO's seeds are the prompt's queries,
# and at an answer's first tokens the reuse heads missed half the needle positions Exact Top-K read, at
# similarities no threshold distrusts; on jargon's NIAH, where the default lost to Exact Top-K at the list's first
# item, it answered every case as Exact Top-K did, for 0.3-2.5 more points of group reads over 128 steps (most of
# a turn's first steps fall back anyway; a short answer pays a larger share; docs/evaluation.md, "Quality across
# corpora").
# r* 0.75 rather than session 19's 0.72 (session 22): the default's one NIAH loss left to Exact Top-K
# (debian-reference at 4096) was a near tie, 0.12 nats in Exact Top-K's own distribution at an answer's 12th
# token, flipped by the small support errors of heads that reused (their recall 0.95 in layers 0-4, feeding the
# answer's own keys), not by a missed needle: no per-head signal singles it out, a tighter calibration
# everywhere does. From 0.75 on the default answered it, and all 48 cases there, as Exact Top-K did; it costs about
# 2 points of group reads (jargon 8000: 24.5%, under the 25% target, where 0.76 read 25.4%) and leaves ΔPPL as it
# was (docs/bench/history.md, 2026-12-06, helper h40).
# The core's ReTopKConfig() keeps the paper's defaults.
DEFAULT_METHOD_PARAMS = {"top_k": 64, "gqa_policy": "head", "tau": 0.85, "tau_calibration": 0.75, "refresh_every": 32,
                         "tau_guard": 0.5, "recall_successors": True, "refresh_first": 8, "cache_size": 128,
                         "window": 128, "dense_below": 1024}


def default_method_spec() -> MethodSpec:
    """The server's default method: ReTopK with DEFAULT_METHOD_PARAMS."""
    return MethodSpec("retopk", tuple(DEFAULT_METHOD_PARAMS.items()))


@dataclass
class RuntimeConfig:
    """How the runner loads and drives the model.

    model           a name known to ``retopk_core.models`` (e.g. "smollm2-135m") or a local checkpoint path
    device          where the weights, KV cache and method state live
    weights         the matmul weights' format (runtime/decoder/load.py): "as-stored" (a GGUF file's quantized
                    tensors without widening them: Q4_0 / Q4_1 as int4 and Q8_0 as int8, in blocks of 32; a
                    checkpoint's own float dtype), "float32", "bfloat16", "float16", "int8", "int4" (weight-only,
                    blocks of 32), or "auto": as-stored on a CPU, bfloat16 on CUDA (the block kernels are CPU ones)
    kv_dtype        the KV cache's dtype: "float32", "bfloat16", "float16", or "auto" (kv_torch_dtype): float16
                    on a CPU, bfloat16 on CUDA (16 bits: half the bytes every exact pass and dense step reads;
                    attention accumulates in float32 either way; float16 writes saturate at ±65504). With
                    float32 the quantized formats' prefill GEMMs run in float32 too (decoder/linear.py), so that
                    the whole model equals the dequantized float32 one up to the order of its sums
    activations     what the block formats' decode products (int4 / int8 weights, on a CPU) multiply their
                    weights with: "float32" (x as it is: the dequantized model's products up to the order of
                    the sums) or "int8" (x quantized per row and block of 32 to int8 with one float scale, as
                    llama.cpp does, then integer block dots: retopk_core/cpu/decoder_ops.cpp) or "bf16x2" (x as
                    two bf16 limbs, hi + lo, on AMX tiles: on CPUs with AMX-BF16 only, refused elsewhere;
                    about 16 bits of x, where float32 keeps 24) or "int16" (x quantized per row and block of 32
                    to int16 with one float scale, 2^-16 of the block's largest |x|, then exact integer block dots:
                    on every CPU, AVX-512 VNNI's dpwssd where there is one). Prefill GEMMs through the dequantized copy
                    (decoder/linear.py's rule; int16 against a 16-bit copy, as with a 16-bit KV cache on a CPU with
                    AVX-512 BF16, multiplies every prefill row on the blocks and holds no copy), norms and the
                    residual stream stay as they are. Refused for
                    a device other than the CPU and for a model without block weights. "auto" (the default):
                    bf16x2 where the decoder accepts it (a CPU device with AMX-BF16, block weights whose out
                    features are multiples of 16: Decoder.auto_activations), else int16 where it accepts that
                    and the block products run at AVX-512 VNNI's level (AMD Zen 4, Intel without AMX), else
                    float32; resolved once at load, and what it resolved to is what ModelInfo's weight_format
                    shows
    backend         "torch" (the reference code, any device), "triton" (GPU kernels), "cpu" (ReTopK, Full and
                    Exact Top-K through the fused C++ kernel, retopk_core/cpu, the other methods' torch code) or
                    "auto": "cpu" on a CPU device where that kernel was built and loads, else "torch"; see
                    ``method_backend``
    default_method  the method of a session opened without one
    max_context     longest context a session may hold; default the model's max_position_embeddings
                    (times the RoPE scaling factor when ``rope_scaling`` is set). Larger than the trained
                    positions without ``rope_scaling`` is refused.
    rope_scaling    transformers' RoPE parameters to extend the context, e.g. {"rope_type": "linear",
                    "factor": 4.0}; rope_theta is kept from the model, other keys the type needs (yarn, llama3)
                    are the caller's. Applied to the model in place. The long-context benchmarks on the small
                    model use this; quality beyond the trained positions is whatever the scaling gives.
    prefill_chunk   prompt tokens per dense prefill forward (bounds the T x L score matrix of one chunk)
    kv_block_size   positions per KV block (the pool grows by doubling its block count)
    kv_cache_bytes  the cache budget: bytes the KV block pool and the method-state pools may hold together
                    (runtime/budget.py); None: ``kv_cache_fraction`` of the memory free on the device once the
                    model is loaded (CUDA: mem_get_info's free, CPU: MemAvailable)
    kv_cache_fraction  that share when kv_cache_bytes is None, in (0, 1]
    prefix_cache    keep the full KV blocks of first prefills for later prompts that start with the same tokens
                    (runtime/prefix_cache.py); False: every prompt is prefilled whole
    prefix_cache_bytes  the most bytes the cached blocks no session holds (and their tail queries) keep once a
                    session closes, least recently used evicted first; None: up to the cache budget (they go
                    when an allocation needs the room)
    """

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    weights: str = "auto"
    kv_dtype: str = "auto"
    activations: str = "auto"
    backend: str = "auto"
    default_method: MethodSpec = field(default_factory=default_method_spec)
    max_context: int | None = None
    rope_scaling: dict | None = None
    prefill_chunk: int = 512
    kv_block_size: int = 256
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = DEFAULT_CACHE_FRACTION
    prefix_cache: bool = True
    prefix_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.activations not in ACTIVATION_CHOICES:
            raise ValueError(f"activations must be one of {', '.join(ACTIVATION_CHOICES)}, got {self.activations!r}")
        if self.activations not in ("auto", "float32") and not self.device.startswith("cpu"):
            raise ValueError(f"activations={self.activations} needs device cpu (the block kernels are CPU ones), "
                             f"got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not isinstance(self.default_method, MethodSpec):
            raise ValueError(f"default_method must be a MethodSpec, got {self.default_method!r}")
        check_int("prefill_chunk", self.prefill_chunk)
        check_int("kv_block_size", self.kv_block_size)
        check_int("max_context", self.max_context, optional=True)
        check_int("kv_cache_bytes", self.kv_cache_bytes, optional=True)
        check_int("prefix_cache_bytes", self.prefix_cache_bytes, low=0, optional=True)
        check_number("kv_cache_fraction", self.kv_cache_fraction, low=0, high=1)
        if not isinstance(self.prefix_cache, bool):
            raise ValueError(f"prefix_cache must be True or False, got {self.prefix_cache!r}")
        if not self.kv_cache_fraction > 0:
            raise ValueError(f"kv_cache_fraction must lie in (0, 1], got {self.kv_cache_fraction!r}")
        if self.rope_scaling is not None:
            rs = self.rope_scaling
            if not isinstance(rs, dict) or rs.get("rope_type") not in ROPE_TYPES:
                raise ValueError(f"rope_scaling must be a dict with rope_type in {', '.join(ROPE_TYPES)}, got {rs!r}")
            factor = rs.get("factor")
            if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1.0:
                raise ValueError(f"rope_scaling factor must be a number >= 1, got {factor!r}")

    def method_backend(self, method: str) -> str:
        """The backend handed to method ``method`` (a registry name): "cpu" only to the methods with a fused CPU
        kernel (FUSED_CPU: ReTopK, Full attention, Exact Top-K), the others' torch code otherwise."""
        backend = self.backend
        if backend == "auto":
            import torch

            from retopk_core.cpu import launch

            cpu = torch.device(self.device).type == "cpu"
            backend = "cpu" if cpu and method in FUSED_CPU and launch.available() else "torch"
        return "torch" if backend == "cpu" and method not in FUSED_CPU else backend

    def weight_format(self) -> str:
        """``weights`` with "auto" resolved for the device."""
        if self.weights != "auto":
            return self.weights
        import torch

        return "as-stored" if torch.device(self.device).type == "cpu" else "bfloat16"

    @property
    def kv_torch_dtype(self):
        """``kv_dtype`` as a torch dtype, "auto" resolved for the device: float16 on a CPU, where its 10-bit mantissa
        keeps the float32 model's greedy tokens that bfloat16's 7 bits flip and the fused kernel reads it as fast
        (F16C; issue 28's measurements in docs/bench/history.md), bfloat16 on CUDA (float32's range)."""
        import torch

        if self.kv_dtype == "auto":
            return torch.float16 if torch.device(self.device).type == "cpu" else torch.bfloat16
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.kv_dtype]
