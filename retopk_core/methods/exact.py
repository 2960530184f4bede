"""Exact Top-K attention: score every cached key, keep the K best, softmax-attend over them.

S_t = TopK_i(q_t . k_i / sqrt(d), K) over all L_t positions (equation 1), then equation 12 over S_t.
ReTopK's fallback and refresh paths call the same ``exact_select`` + ``sparse_attend``, so the
two methods differ only in how the support is discovered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.cpu import launch as cpu_launch
from retopk_core.kv import PagedKV
from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput, uniform_output
from retopk_core.methods.sparse import Workspace, exact_select, resolve_scale, sparse_attend
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

    @property
    def top_k(self) -> int:
        return self.config.top_k

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        if self.backend == "triton":
            from retopk_core.kernels.triton_launch import exact_topk_decode
            out, sel_pos = exact_topk_decode(q, kv, self.top_k, scale)
        elif self.backend == "cpu" and cpu_launch.usable(q):
            out, sel_pos = cpu_launch.dense_decode(q, kv, scale, self.top_k, exact=True)
        else:
            sel_pos, sel_scores = exact_select(q, kv, self.top_k, scale, ws=self._ws)  # (B, H, K)
            if self.on_stage:
                self.on_stage("full QK + top-K")
            out = sparse_attend(kv, sel_pos, sel_scores, q.dtype, self._ws)  # (B, H, d_v)
            if self.on_stage:
                self.on_stage("sparse attend")
        return uniform_output(out, Path.EXACT, kv.lengths, sel_pos)
