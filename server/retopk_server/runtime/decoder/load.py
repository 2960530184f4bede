"""Building a Decoder: from a transformers model's modules, or from a GGUF file's tensors as stored.

Weight formats (``--weights``): "as-stored" serves a GGUF file's quantized tensors without widening them
(Q4_0 / Q4_1 -> int4 and Q8_0 -> int8, their blocks of 32 as the file holds them; F32 / F16 / BF16 as
such) and a checkpoint's weights in their own float dtype; "float32", "bfloat16", "float16", "int8",
"int4" convert every matmul weight (dequantizing a GGUF first). Norms, biases and the residual stream stay
float32 in every format.
"""

from __future__ import annotations

import numpy as np
import torch

from retopk_server.runtime.decoder.linear import DenseLinear, Int4Linear, Int8Linear, Linear, from_float
from retopk_server.runtime.decoder.llama import Decoder, LayerWeights

ARCHITECTURES = ("llama", "mistral", "qwen2")


class DenseEmbedding:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight  # (V, D)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight).float()  # (N, D)

    def to(self, device: torch.device) -> DenseEmbedding:
        return DenseEmbedding(self.weight.to(device))


class BlockEmbedding:
    """Rows of a block-quantized table (Q8_0: w = d * q per block of 32), dequantized exactly on lookup."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor) -> None:
        # (V, D) int8, (V, D / 32) float32 (float16 widened once, exactly: a lookup then converts only q)
        self.q, self.d = q, d.float()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (N,) -> (N, D) float32: each q widened to float32 and times its block's d (one rounding)."""
        N = ids.shape[0]
        q = self.q.index_select(0, ids).view(N, -1, 32)  # (N, D/32, 32) int8, widened to float32 by the product
        return (q * self.d.index_select(0, ids).unsqueeze(-1)).view(N, -1)  # (N, D)

    def to(self, device: torch.device) -> BlockEmbedding:
        return BlockEmbedding(self.q.to(device), self.d.to(device))


def rotary_for(config) -> torch.nn.Module:
    """transformers' rotary embedding for ``config`` (the Llama class: Mistral's and Qwen2's compute the same)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config=config)


def _shape(config) -> tuple[int, int, int]:
    H = int(config.num_attention_heads)
    H_kv = int(getattr(config, "num_key_value_heads", None) or H)
    d = int(getattr(config, "head_dim", None) or config.hidden_size // H)
    return H, H_kv, d


def check_architecture(config) -> None:
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"model type {config.model_type!r} is not served: the decoder implements "
                         f"{', '.join(ARCHITECTURES)}")


# ---- transformers modules ----------------------------------------------------------------------------
def from_transformers(model, weights: str = "as-stored") -> Decoder:
    """A Decoder over a transformers Llama / Mistral / Qwen2 causal LM's weights in format ``weights``
    ("as-stored": the model's own float dtype). The model's tensors are copied, not shared."""
    config = model.config
    check_architecture(config)
    H, H_kv, d = _shape(config)
    base = model.model

    def lin(*mods) -> Linear:
        w = torch.cat([m.weight.detach() for m in mods])  # (sum of outs, in), a copy
        b = None
        if any(m.bias is not None for m in mods):
            b = torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(m.weight.shape[0])
                           for m in mods])
        return from_float(w, b, str(w.dtype).removeprefix("torch.") if weights == "as-stored" else weights)

    layers = []
    for layer in base.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(LayerWeights(
            attn_norm=layer.input_layernorm.weight.detach().float().clone(), qkv=lin(a.q_proj, a.k_proj, a.v_proj),
            o=lin(a.o_proj), mlp_norm=layer.post_attention_layernorm.weight.detach().float().clone(),
            gate_up=lin(m.gate_proj, m.up_proj), down=lin(m.down_proj)))
    embed = base.embed_tokens.weight.detach()
    return Decoder(num_heads=H, num_kv_heads=H_kv, head_dim=d, eps=float(config.rms_norm_eps),
                   embed=DenseEmbedding(embed.float().clone()), layers=layers,
                   norm=base.norm.weight.detach().float().clone(), lm_head=lin(model.lm_head),
                   rotary=rotary_for(config))


# ---- GGUF tensors ------------------------------------------------------------------------------------
Q4_0, Q4_1, Q8_0 = "Q4_0", "Q4_1", "Q8_0"
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _q4_blocks(data: np.ndarray, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q4_0 / Q4_1 rows (out, bytes) -> qs (out, in / 2) uint8 as stored, scales (out, in / 32, 2) float16
    (d, m) with w = d q + m. A block: f16 d [, f16 m], 16 bytes whose low nibbles are elements 0..15 and high
    nibbles 16..31; Q4_1: w = d q + m, Q4_0: w = d (q - 8), so m = -8 d (exact in float16)."""
    size = 20 if qtype == Q4_1 else 18
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, size)  # (out, in/32, size)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]  # (out, in/32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == Q4_1 else -8 * d
    qs = np.ascontiguousarray(blocks[..., size - 16:]).reshape(rows, -1)  # (out, in/2)
    return torch.from_numpy(qs), torch.from_numpy(np.stack([d, m], axis=-1))


def _q8_blocks(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw Q8_0 rows (out, bytes) -> q (out, in) int8, d (out, in / 32) float16 with w = d q."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return torch.from_numpy(q), torch.from_numpy(d)


class GGUFTensors:
    """The tensors of a GGUF file by name, each as raw rows (out, ...) with the file's Q/K row order undone."""

    def __init__(self, path: str, config) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        self.arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
        self.tensors = {t.name: t for t in reader.tensors}
        self.H, self.H_kv, _ = _shape(config)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def rows(self, name: str) -> tuple[str, np.ndarray]:
        """(type name, data (out, ...)); Q and K rows back in the checkpoint's order: llama.cpp's converter
        interleaves each head's two RoPE halves for its llama architecture, transformers' loader and this
        undo it (the rows carry whole blocks, so quantized data permutes as it is)."""
        t = self.tensors[name]
        data = np.asarray(t.data)
        if self.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = self.H if ".attn_q." in name else self.H_kv
            rows = data.shape[0]
            data = data.reshape(heads, rows // heads // 2, 2, *data.shape[1:]).swapaxes(2, 1).reshape(data.shape)
        return t.tensor_type.name, data

    def float(self, name: str) -> torch.Tensor:
        """The tensor dequantized to float32, (out, in)."""
        from gguf import dequantize

        _, data = self.rows(name)
        t = self.tensors[name]
        w = np.array(dequantize(data, t.tensor_type), dtype=np.float32)  # a writable copy (F32 tensors map the file)
        return torch.from_numpy(w).float().reshape(data.shape[0], -1)

    def linear(self, names: list[str], weights: str) -> Linear:
        """The named matmul weights stacked along their outputs (fused QKV, gate-up), in ``weights``."""
        types = {self.tensors[n].tensor_type.name for n in names}
        biases = [n.replace(".weight", ".bias") for n in names]
        bias = torch.cat([self.float(b).view(-1) for b in biases]) if all(self.has(b) for b in biases) else None
        if weights == "as-stored" and len(types) == 1:
            qtype = types.pop()
            if qtype in (Q4_0, Q4_1):
                parts = [_q4_blocks(self.rows(n)[1], qtype) for n in names]
                return Int4Linear(*(torch.cat([p[i] for p in parts]) for i in range(2)), bias)
            if qtype == Q8_0:
                parts = [_q8_blocks(self.rows(n)[1]) for n in names]
                return Int8Linear(*(torch.cat([p[i] for p in parts]) for i in range(2)), bias)
            if qtype in FLOAT_TYPES:
                return DenseLinear(torch.cat([self.float(n) for n in names]).to(FLOAT_TYPES[qtype]), bias)
        fmt = "float32" if weights == "as-stored" else weights
        return from_float(torch.cat([self.float(n) for n in names]), bias, fmt)

    def embedding(self, name: str, weights: str):
        qtype, data = self.rows(name)
        if weights == "as-stored" and qtype == Q8_0:
            return BlockEmbedding(*_q8_blocks(data))
        return DenseEmbedding(self.float(name))


def from_gguf(path: str, config, weights: str = "as-stored") -> Decoder:
    """A Decoder over a GGUF file's tensors (llama.cpp's names) in format ``weights``."""
    check_architecture(config)
    g = GGUFTensors(path, config)
    H, H_kv, d = _shape(config)
    layers = []
    for i in range(int(config.num_hidden_layers)):
        p = f"blk.{i}."
        layers.append(LayerWeights(
            attn_norm=g.float(p + "attn_norm.weight").view(-1),
            qkv=g.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], weights),
            o=g.linear([p + "attn_output.weight"], weights), mlp_norm=g.float(p + "ffn_norm.weight").view(-1),
            gate_up=g.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], weights),
            down=g.linear([p + "ffn_down.weight"], weights)))
    head = "output.weight" if g.has("output.weight") else "token_embd.weight"  # tied embeddings: no output
    lm_head = g.linear([head], weights)
    tied_blocks = head == "token_embd.weight" and isinstance(lm_head, Int8Linear)  # one Q8_0 table serves both
    embed = BlockEmbedding(lm_head.qs, lm_head.scales) if tied_blocks else g.embedding("token_embd.weight", weights)
    return Decoder(num_heads=H, num_kv_heads=H_kv, head_dim=d, eps=float(config.rms_norm_eps),
                   embed=embed, layers=layers, norm=g.float("output_norm.weight").view(-1), lm_head=lm_head,
                   rotary=rotary_for(config))
