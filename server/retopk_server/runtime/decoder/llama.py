"""The decoder step of Llama-family models (Llama, Mistral, Qwen2), as small pure functions over weights.

One forward feeds T tokens to each of B rows (a prefill chunk: B = 1; a decode step: T = 1) and returns
the logits after each row's last token. Per layer, with x the float32 residual stream (B*T, D):

    h = rmsnorm(x) * w_attn;  q, k, v = split(h W_qkv^T + b_qkv);  q, k = rope(q, k, positions)
    x += attend(layer, q, k, v) W_o^T                 # the runtime's paged KV cache and attention core
    h = rmsnorm(x) * w_mlp;   g, u = split(h W_gate_up^T);  x += (silu(g) * u) W_down^T

rmsnorm(x) = x / sqrt(mean(x^2) + eps). The projections are fused (one QKV matmul, one gate-up matmul)
and held in any weight format of linear.py; RoPE's cos / sin come from transformers' own rotary
embedding for the model's config (every RoPE type it supports), once per forward for all layers, and
rotate q and k in one pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retopk_server.runtime.decoder.linear import Linear

# attend(layer, q (B, H, T, d), k (B, H_kv, T, d), v (B, H_kv, T, d), scale) -> (B, H, T, d)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (D,) float32
    qkv: Linear  # (H*d + 2*H_kv*d, D)
    o: Linear  # (D, H*d)
    mlp_norm: torch.Tensor  # (D,) float32
    gate_up: Linear  # (2F, D)
    down: Linear  # (D, F)


@dataclass
class Decoder:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    embed: Callable[[torch.Tensor], torch.Tensor]  # token ids (N,) -> (N, D) float32
    layers: list[LayerWeights]
    norm: torch.Tensor  # (D,) float32
    lm_head: Linear  # (V, D)
    rotary: torch.nn.Module  # transformers' rotary embedding: (x, positions (B, T)) -> cos, sin (B, T, d)

    def to(self, device: torch.device) -> Decoder:
        """This decoder with every tensor on ``device`` (itself on the CPU)."""
        if torch.device(device).type == "cpu":
            return self
        move = [LayerWeights(layer.attn_norm.to(device), layer.qkv.to(device), layer.o.to(device),
                             layer.mlp_norm.to(device), layer.gate_up.to(device), layer.down.to(device))
                for layer in self.layers]
        return Decoder(self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.embed.to(device), move,
                       self.norm.to(device), self.lm_head.to(device), self.rotary.to(device))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matmul's weights and the norms (the embedding
        row is one row, not counted)."""
        total = self.lm_head.nbytes + self.norm.numel() * 4
        for layer in self.layers:
            total += sum(lin.nbytes for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            total += (layer.attn_norm.numel() + layer.mlp_norm.numel()) * 4
        return total

    @property
    def weight_format(self) -> str:
        """The formats of the layers' matmuls and of the LM head, e.g. "int4, lm_head int8"."""
        body = sorted({lin.format for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)})
        return f"{'+'.join(body)}, lm_head {self.lm_head.format}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (N, D) float32 -> x / sqrt(mean(x^2) + eps) * weight (one torch op; on a CPU it runs as five)."""
    return torch.rms_norm(x, weight.shape, weight, eps)


def rope_tables(rotary: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin (B, 1, T, d) for ``rope``: transformers' rotate-half RoPE, x * cos + rotate_half(x) *
    sin with rotate_half(x) = (-x2, x1), is x * cos + roll(x, d/2) * (-sin1, sin2)."""
    cos, sin = rotary(x, positions)  # (B, T, d)
    half = sin.shape[-1] // 2
    signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    return cos.unsqueeze(1), signed.unsqueeze(1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) -> x rotated."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def layer_step(layer: LayerWeights, dec: Decoder, index: int, x: torch.Tensor, shape: tuple[int, int],
               cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder layer on x (B*T, D) -> the new residual stream (B*T, D)."""
    B, T = shape
    H, H_kv, d = dec.num_heads, dec.num_kv_heads, dec.head_dim
    qkv = layer.qkv(rms_norm(x, layer.attn_norm, dec.eps)).view(B, T, H + 2 * H_kv, d).transpose(1, 2)
    qk = rope(qkv[:, :H + H_kv], cos, sin)  # (B, H + H_kv, T, d): q and k rotated together
    out = attend(index, qk[:, :H], qk[:, H:], qkv[:, H + H_kv:], 1.0 / math.sqrt(d))  # (B, H, T, d)
    x = x + layer.o(out.transpose(1, 2).reshape(B * T, H * d))
    gate, up = layer.gate_up(rms_norm(x, layer.mlp_norm, dec.eps)).chunk(2, dim=-1)  # (B*T, F) each
    return x + layer.down(F.silu(gate) * up)


def forward(dec: Decoder, ids: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
    """ids, positions (B, T) int64 -> float32 logits (B, V) after each row's last token."""
    B, T = ids.shape
    x = dec.embed(ids.reshape(-1))  # (B*T, D) float32
    cos, sin = rope_tables(dec.rotary, x, positions)
    for index, layer in enumerate(dec.layers):
        x = layer_step(layer, dec, index, x, (B, T), cos, sin, attend)
    last = x.view(B, T, -1)[:, -1]  # (B, D)
    return dec.lm_head(rms_norm(last, dec.norm, dec.eps))  # (B, V)
