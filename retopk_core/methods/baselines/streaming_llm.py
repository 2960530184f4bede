"""StreamingLLM (Xiao et al., 2024): attention sinks plus a recent window.

With S sinks and W = top_k - S recent tokens, a sequence of length L (current token included) attends

    A_t = {0, ..., min(S, L) - 1}  ∪  {max(S, L - W), ..., L - 1}

with exact softmax attention over A_t; every head of the sequence attends the same positions. The
paper's setting (and the ReTopK comparison) is S = 64, W = 448 for the shared budget K = 512.

Kept from the paper: the fixed sink + recent pattern and its budget split.
Deviation: the original evicts the middle of the KV cache and assigns positions inside the rolling
cache (RoPE applied relative to cache slots). Here the full cache is kept and keys carry their
original absolute RoPE positions, so this is StreamingLLM's attention pattern as a sparse mask (the
"window attention with sinks" variant used by sparse-attention comparisons), not its memory saving.

Accounting: path APPROX (the fixed selector), n_scored = |A_t| keys scored with the exact query,
n_approx = 0 (the selector scores nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV
from retopk_core.methods.base import Path, SlotPool, StepOutput
from retopk_core.methods.baselines._common import Baseline, attend_positions, full_path, step_output
from retopk_core.methods.sparse import resolve_scale
from retopk_core.params import MethodConfig, ParamError, param


@dataclass(frozen=True)
class StreamingLLMConfig(MethodConfig):
    top_k: int = param(512, "tokens attended per step (S + W)", low=1, context=True)
    sinks: int = param(64, "S initial tokens; the rest (W = top_k - S) is the recent window", low=0)

    def validate(self) -> None:
        if self.sinks >= self.top_k:
            raise ParamError("sinks", f"sinks must be < top_k ({self.top_k}) so the recent window holds the current "
                                      f"token, got {self.sinks}")

    @property
    def recent(self) -> int:
        return self.top_k - self.sinks


def sink_window_positions(lengths: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """Sink + recent positions of each sequence, -1 where absent. lengths (B,) -> (B, sinks + recent)."""
    dev = lengths.device
    L = lengths.view(-1, 1)  # (B, 1)
    sink = torch.arange(sinks, device=dev).view(1, -1).expand(L.shape[0], -1)  # (B, S)
    sink = sink.masked_fill(sink >= L, -1)
    rec = L - recent + torch.arange(recent, device=dev).view(1, -1)  # (B, W) ends at L - 1
    rec = rec.masked_fill(rec < sinks, -1)  # overlaps the sinks (or negative): drop
    return torch.cat([sink, rec], dim=1)


class StreamingLLM(Baseline):
    name = "streaming_llm"
    config_class = StreamingLLMConfig

    def decode(self, q: torch.Tensor, kv: PagedKV, state: SlotPool, slots: torch.Tensor,
               scale: float | None = None) -> StepOutput:
        B, H, d = q.shape
        scale = resolve_scale(scale, d)
        sel = sink_window_positions(kv.lengths.to(q.device), self.config.sinks, self.config.recent)  # (B, K)
        sel = sel.unsqueeze(1).expand(B, H, -1).contiguous()  # (B, H, K) same pattern for every head
        out, n_valid = attend_positions(q, kv, sel, scale)  # (B, H, d_v), (B, H)
        return step_output(out, full_path(B, H, Path.APPROX, q.device), n_valid, sel)

    def describe(self) -> dict:
        return {**super().describe(), "recent": self.config.recent}
