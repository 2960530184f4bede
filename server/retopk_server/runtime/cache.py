"""The transformers Cache the runner passes to the model: it stores new keys/values in the sessions' blocks."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from retopk_server.runtime.attention import StepContext


class RuntimeCache(Cache):
    """Routes ``update(k, v, layer)`` of one forward step to the block pool, row by row.

    k, v: (B, H_kv, T, d) after RoPE. Row b's tokens go to positions ctx.start[b] .. + T - 1 of its
    session. The returned tensors are the new k, v unchanged: the registered attention function reads
    the history from the pool through the step context, so nothing here concatenates the past.
    transformers' mask code sees an empty layer list (sequence length 0, mask sizes = query length);
    the registered mask function ignores them anyway.
    """

    def __init__(self, ctx: StepContext) -> None:
        super().__init__(layers=[])
        self.ctx = ctx

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.ctx.pool.write(layer_idx, self.ctx.table, self.ctx.start, key_states, value_states)
        return key_states, value_states
