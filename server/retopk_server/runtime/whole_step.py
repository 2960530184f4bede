"""A decode step's layers in one call of the fused CPU library, where the step allows it.

``ModelRunner.decode`` runs a step layer by layer in Python (runtime/decoder/llama.py's ``layer_step``, with
attention.py's ``DecodeContext.attend``): per layer two fused decoder calls, the KV store and the method's
step, and the interpreter's work between them. When every matmul holds GGUF blocks (``Decoder.fused``), the
batch is one method group and that method has a fused CPU step for every row (cpu/launch.py's
``attention_kind``: Full attention, Exact Top-K, ReTopK past its dense floor or on its plain floor steps),
the same calls on the same tensors in the same order run in one call instead (decoder_ops.LayerPlan), so
the logits, the KV cache, the method state and the step's statistics equal the layer-by-layer loop's bit for
bit.

The plan (the weights, pools, method state and constants converted for the library) is prepared once per
method group and attention kind and kept in ``MethodGroup.plans``; it is prepared again when the KV pool's
tensors or the group's state tensors were replaced since (their ``generation`` counters: the pool grown or
trimmed, the state pools grown or shrunk) or the activations changed. It holds the pools and the state
weakly, so a kept plan never keeps replaced memory alive.
"""

from __future__ import annotations

import torch

from retopk_core.cpu import decoder_ops
from retopk_core.cpu.launch import attention_kind, layer_attention
from retopk_core.methods.step_output import uniform_output
from retopk_server.runtime.attention import DecodeContext, MethodGroup
from retopk_server.runtime.decoder.llama import Decoder, Layers
from retopk_server.runtime.kv_pool import KVPool


def prepared(dec: Decoder, pool: KVPool, group: MethodGroup, kind: int) -> decoder_ops.LayerPlan:
    """The plan of ``group``'s method with attention ``kind`` on ``dec``'s weights and ``pool``: the kept one
    while nothing it holds was replaced, else a new one (kept)."""
    key = (pool.generation, sum(s.generation for s in group.states), dec.activations)  # each generation only grows
    kept = group.plans.get(kind)
    if kept is not None and kept[0] is dec and kept[1] is pool and kept[2] == key:
        return kept[3]
    weights, bits = dec.layer_arguments
    plan = decoder_ops.LayerPlan(weights, bits, dec.eps, (dec.num_heads, dec.num_kv_heads, dec.head_dim), pool.k,
                                 pool.v, layer_attention(group.method, group.states, kind), dec.activations)
    group.plans[kind] = (dec, pool, key, plan)
    return plan


def whole_step(dec: Decoder, ctx: DecodeContext, lengths: list[int]) -> Layers | None:
    """The layers of the step ``ctx`` as one call -> ``forward``'s ``layers``, or None where the step must run
    layer by layer. ``lengths``: each row's positions with this step's token."""
    kv = ctx.kv
    B = kv.table.shape[0]
    if not (dec.fused_rows(B) and kv.table.device.type == "cpu" and len(ctx.groups) == 1
            and ctx.groups[0].rows is None):
        return None
    dg = ctx.groups[0]
    kind = attention_kind(dg.group.method, min(lengths), max(lengths))
    if kind is None:
        return None
    plan = prepared(dec, kv.pool, dg.group, kind)

    def layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x, seconds, stats = plan(x, cos, sin, kv.new_rows(1), kv.table, kv.lengths, dg.slots, ctx.with_stats)
        if ctx.with_stats:
            if not stats:  # a dense kind: every head of every layer took its path over all of its keys
                dense = uniform_output(x.new_empty(B, dec.num_heads, 0), plan.path, kv.lengths)
                stats = [(dense.path, dense.max_sim, dense.n_scored)] * len(dec.layers)
            ctx.stats[0] = list(stats)
            ctx.attention_s[0] += seconds
        return x

    return layers


__all__ = ["prepared", "whole_step"]
