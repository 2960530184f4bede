"""The model runtime: transformers causal LMs with attention routed to the ReTopK core, sessions, sampling."""

from retopk_server.runtime.config import RuntimeConfig
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.runner import ContextTooLong, ModelInfo, ModelRunner
from retopk_server.runtime.sampling import Sampler, SamplingParams, StopChecker
from retopk_server.runtime.session import Session
from retopk_server.runtime.stats import StepStats

__all__ = ["ContextTooLong", "MethodSpec", "ModelInfo", "ModelRunner", "RuntimeConfig", "Sampler", "SamplingParams",
           "Session", "StepStats", "StopChecker"]
