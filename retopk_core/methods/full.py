"""Full attention: every cached position, softmax(q K^T * scale) V. The quality reference."""

from __future__ import annotations

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.backend_steps import steps_for
from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput, uniform_output
from retopk_core.methods.sparse import resolve_scale
from retopk_core.params import MethodConfig


class FullAttention(AttentionMethod):
    name = "full"  # no hyperparameters: its config is the empty MethodConfig
    backends = ("torch", "triton", "cpu")  # cpu: the fused C++ kernel (retopk_core/cpu), else the torch code

    def __init__(self, config: MethodConfig | None = None, backend: str = "torch") -> None:
        super().__init__(config, backend)
        self.steps = steps_for(self.backend)  # methods/backend_steps.py

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        out = self.steps.dense(q, kv, scale)  # (B, H, d_v)
        return uniform_output(out, Path.DENSE, kv.lengths)
