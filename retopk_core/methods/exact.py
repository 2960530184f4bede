"""Exact Top-K attention: score every cached key, keep the K best, softmax-attend over them.

S_t = TopK_i(q_t . k_i / sqrt(d), K) over all L_t positions (equation 1), then equation 12 over S_t.
ReTopK's fallback and refresh paths call the same ``exact_select`` + ``sparse_attend``, so the
two methods differ only in how the support is discovered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.backend_steps import steps_for
from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput, uniform_output
from retopk_core.methods.sparse import Workspace, resolve_scale
from retopk_core.params import MethodConfig, param


@dataclass(frozen=True)
class ExactTopKConfig(MethodConfig):
    top_k: int = param(512, "K: tokens attended per head and step (the global Top-K)", low=1, context=True)


class ExactTopK(AttentionMethod):
    name = "exact_topk"
    config_class = ExactTopKConfig
    backends = ("torch", "triton", "cpu")  # cpu: the fused C++ kernel (retopk_core/cpu), else the torch code

    def __init__(self, config: ExactTopKConfig | None = None, backend: str = "torch") -> None:
        super().__init__(config, backend)
        self._ws = Workspace()  # score rows and selected values, reused across steps
        self.steps = steps_for(self.backend)  # methods/backend_steps.py

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        # (B, H, d_v), (B, H, K)
        out, sel_pos = self.steps.exact_topk(q, kv, self.top_k, scale, self._ws)
        return uniform_output(out, Path.EXACT, kv.lengths, sel_pos)
