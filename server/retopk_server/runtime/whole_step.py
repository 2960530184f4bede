"""A decode step's layers in one call of the fused CPU library, where the step allows it.

``ModelRunner.decode`` runs a step layer by layer in Python (runtime/decoder/llama.py's ``layer_step``, with
attention.py's ``DecodeContext.attend``): per layer two fused decoder calls, the KV store and the method's
step, and the interpreter's work between them. When every matmul holds GGUF blocks (``Decoder.fused``), the
batch is one method group and that method has a fused CPU step for every row (cpu/launch.py's
``layer_attention``: Full attention, Exact Top-K, ReTopK past its dense floor or on its plain floor steps),
the same calls on the same tensors in the same order run in one call instead (decoder_ops.decode_layers), so
the logits, the KV cache, the method state and the step's statistics equal the layer-by-layer loop's bit for
bit.
"""

from __future__ import annotations

import torch

from retopk_core.cpu import decoder_ops
from retopk_core.cpu.launch import layer_attention
from retopk_core.methods.step_output import uniform_output
from retopk_server.runtime.attention import DecodeContext
from retopk_server.runtime.decoder.llama import Decoder, Layers


def whole_step(dec: Decoder, ctx: DecodeContext, lengths: list[int]) -> Layers | None:
    """The layers of the step ``ctx`` as one call -> ``forward``'s ``layers``, or None where the step must run
    layer by layer. ``lengths``: each row's positions with this step's token."""
    kv = ctx.kv
    B = kv.table.shape[0]
    if not (dec.fused_rows(B) and kv.table.device.type == "cpu" and len(ctx.groups) == 1
            and ctx.groups[0].rows is None):
        return None
    dg = ctx.groups[0]
    attention = layer_attention(dg.group.method, dg.group.states, dg.slots, min(lengths), max(lengths))
    if attention is None:
        return None
    weights, bits = dec.layer_arguments

    def layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if kv.rows is None:
            kv.rows = kv.pool.rows(kv.table, kv.start, 1)  # (B, H_kv, 1)
        x, seconds, stats = decoder_ops.decode_layers(
            x, weights, bits, dec.eps, cos, sin, (dec.num_heads, dec.num_kv_heads, dec.head_dim), kv.pool.k,
            kv.pool.v, kv.rows, kv.table, kv.lengths, attention, dec.activations)
        if ctx.with_stats:
            if not stats:  # a dense kind: every head of every layer took its path over all of its keys
                dense = uniform_output(x.new_empty(B, dec.num_heads, 0), attention.path, kv.lengths)
                stats = [(dense.path, dense.max_sim, dense.n_scored)] * len(dec.layers)
            ctx.stats[0] = list(stats)
            ctx.attention_s[0] += seconds
        return x

    return layers


__all__ = ["whole_step"]
