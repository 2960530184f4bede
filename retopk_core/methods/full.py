"""Full attention: every cached position, softmax(q K^T * scale) V. The quality reference."""

from __future__ import annotations

import torch

from retopk_core.cpu import launch as cpu_launch
from retopk_core.kv import PagedKV
from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput, uniform_output
from retopk_core.methods.sparse import dense_attend, resolve_scale


class FullAttention(AttentionMethod):
    name = "full"  # no hyperparameters: its config is the empty MethodConfig
    backends = ("torch", "triton", "cpu")  # cpu: the fused C++ kernel (retopk_core/cpu), else the torch code

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        if self.backend == "triton":
            from retopk_core.kernels.triton_launch import dense_decode
            out = dense_decode(q, kv, scale)
        elif self.backend == "cpu" and cpu_launch.usable(q):
            out, _ = cpu_launch.dense_decode(q, kv, scale)
        else:
            out = dense_attend(q, kv, scale)  # (B, H, d_v)
        return uniform_output(out, Path.DENSE, kv.lengths)
