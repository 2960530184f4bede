"""One step object per backend, chosen once when a method is built (``steps_for``).

    TorchSteps   the readable reference, torch only (methods/sparse.py), on any device
    CpuSteps     the fused C++/OpenMP kernel (retopk_core/cpu); a "cpu" method gets it where the kernel loads,
                 else TorchSteps (its describe() says so). A tensor off the CPU takes its torch twin.
    TritonSteps  the GPU kernels (retopk_core/kernels), imported at the first step

What a method asks of its steps (q (B, H, d) after RoPE, kv a PagedKV, out (B, H, d_v) in q.dtype):

    dense(q, kv, scale)               -> out: softmax over every position (Full attention, the dense floor)
    dense_topk(q, kv, scale, K)       -> out, sel_pos (B, H, K) int64: the same, with each head's exact Top-K
                                         from the same scores (the floor's last C steps, which seed the FIFO)
    exact_topk(q, kv, K, scale, ws) -> out, sel_pos: softmax over each head's Top-K (eq. 1, 12)
    seed_topk(scores (N, L), K)       -> (N, K) int64: each row's Top-K positions (ReTopK's prefill)
    retopk(method, q, kv, state, slots, scale) -> StepOutput, or None where ReTopK's own torch code runs it

``retopk_floor``: the backend's ReTopK step decides the dense floor itself (Triton, on the device); else the
method splits the batch at the floor first. ``sorted_seeds``: the prefill's supports must come sorted by
position (Triton's selector merges them; the torch and CPU steps read supports as sets).
"""

from __future__ import annotations

import torch

from retopk_core.cpu import launch as cpu_launch
from retopk_core.kv import PagedKV
from retopk_core.methods.sparse import dense_attend, dense_attend_topk, exact_select, sparse_attend, topk_select
from retopk_core.methods.step_output import StepOutput


class TorchSteps:
    """The torch reference of every step."""

    name = "torch"
    retopk_floor = False
    sorted_seeds = False

    def dense(self, q: torch.Tensor, kv: PagedKV, scale: float) -> torch.Tensor:
        return dense_attend(q, kv, scale)

    def dense_topk(self, q: torch.Tensor, kv: PagedKV, scale: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dense_attend_topk(q, kv, scale, k)

    def exact_topk(self, q: torch.Tensor, kv: PagedKV, k: int, scale: float, ws,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        sel_pos, sel_scores = exact_select(q, kv, k, scale, ws=ws)  # (B, H, K)
        out = sparse_attend(kv, sel_pos, sel_scores, q.dtype, ws)  # (B, H, d_v)
        return out, sel_pos

    def seed_topk(self, scores: torch.Tensor, k: int) -> torch.Tensor:
        return topk_select(scores, None, k)[0]

    def retopk(self, method, q: torch.Tensor, kv: PagedKV, state, slots: torch.Tensor, scale: float,
               ) -> StepOutput | None:
        return None


class CpuSteps(TorchSteps):
    """The fused CPU kernel's steps (one call per layer); a tensor off the CPU runs the torch twin."""

    name = "cpu"

    def dense(self, q, kv, scale):
        if q.device.type != "cpu":
            return super().dense(q, kv, scale)
        return cpu_launch.dense_decode(q, kv, scale)[0]

    def dense_topk(self, q, kv, scale, k):
        if q.device.type != "cpu":
            return super().dense_topk(q, kv, scale, k)
        return cpu_launch.dense_decode(q, kv, scale, k)

    def exact_topk(self, q, kv, k, scale, ws):
        if q.device.type != "cpu":
            return super().exact_topk(q, kv, k, scale, ws)
        return cpu_launch.dense_decode(q, kv, scale, k, exact=True)

    def seed_topk(self, scores, k):
        if scores.device.type != "cpu" or scores.stride(-1) != 1:
            return super().seed_topk(scores, k)
        return cpu_launch.topk_rows(scores, k)

    def retopk(self, method, q, kv, state, slots, scale):
        if q.device.type != "cpu":
            return None
        return cpu_launch.retopk_decode(method, q, kv, state, slots, scale)


class TritonSteps(TorchSteps):
    """The GPU kernels' steps; ReTopK's is its whole step, the dense floor included."""

    name = "triton"
    retopk_floor = True
    sorted_seeds = True

    def dense(self, q, kv, scale):
        from retopk_core.kernels.triton_launch import dense_decode
        return dense_decode(q, kv, scale)

    def exact_topk(self, q, kv, k, scale, ws):
        from retopk_core.kernels.triton_launch import exact_topk_decode
        return exact_topk_decode(q, kv, k, scale)

    def retopk(self, method, q, kv, state, slots, scale):
        from retopk_core.kernels.triton_launch import retopk_decode
        return retopk_decode(method, q, kv, state, slots, scale)


def steps_for(backend: str) -> TorchSteps:
    """The steps of ``backend`` ("torch", "cpu", "triton"): "cpu" where the fused kernel is not built loads the
    torch steps (cpu/launch.py logs that once)."""
    if backend == "triton":
        return TritonSteps()
    if backend == "cpu" and cpu_launch.available():
        return CpuSteps()
    return TorchSteps()
