"""The decoder step of Llama-family models (Llama, Mistral, Qwen2), as small pure functions over weights.

One forward feeds T tokens to each of B rows (a prefill chunk: B = 1; a decode step: T = 1) and returns
the logits after each row's last token. Per layer, with x the float32 residual stream (B*T, D):

    h = rmsnorm(x) * w_attn;  q, k, v = split(h W_qkv^T + b_qkv);  q, k = rope(q, k, positions)
    x += attend(layer, q, k, v) W_o^T                 # the runtime's paged KV cache and attention core
    h = rmsnorm(x) * w_mlp;   g, u = split(h W_gate_up^T);  x += (silu(g) * u) W_down^T

rmsnorm(x) = x / sqrt(mean(x^2) + eps). The projections are fused (one QKV matmul, one gate-up matmul)
and held in any weight format of linear.py; RoPE's cos / sin come from transformers' own rotary
embedding for the model's config (every RoPE type it supports), once per forward for all layers, and
rotate q and k in one pass. On a CPU, RMSNorm and RoPE run in the fused CPU library (decoder_ops), one
call each instead of several torch ops. When every matmul holds GGUF blocks, a decode step's layer is two
calls into that library around its attention (``decoder_ops.attn_in`` / ``mlp_out``): the same ops in the
same order, without a Python call and a tensor per op in between.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from retopk_core.cpu import decoder_ops
from retopk_server.runtime.decoder.linear import Linear, blocks_path, is_blocks

# attend(layer, q (B, H, T, d), k (B, H_kv, T, d), v (B, H_kv, T, d), scale) -> (B, H, T, d)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# layers(x (B*T, D), cos, sin) -> x: every layer in one call, in place of the loop (runtime/whole_step.py)
Layers = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


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
    activations: str = "float32"  # what the block products multiply with: decoder_ops.ACTIVATIONS, set_activations
    # (rotary, its RopeTable or None where its frequencies are not fixed): rope_table()'s, made on first use
    _rope: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def to(self, device: torch.device) -> Decoder:
        """This decoder with every tensor on ``device`` (itself on the CPU)."""
        if torch.device(device).type == "cpu":
            return self
        move = [LayerWeights(layer.attn_norm.to(device), layer.qkv.to(device), layer.o.to(device),
                             layer.mlp_norm.to(device), layer.gate_up.to(device), layer.down.to(device))
                for layer in self.layers]
        return Decoder(self.num_heads, self.num_kv_heads, self.head_dim, self.eps, self.embed.to(device), move,
                       self.norm.to(device), self.lm_head.to(device), self.rotary.to(device))

    def rope_table(self) -> RopeTable | None:
        """The kept RopeTable of ``rotary`` (made again when ``rotary`` was replaced, as loading.py does), None
        where its frequencies are not fixed (``fixed_rope``)."""
        if self._rope is None or self._rope[0] is not self.rotary:
            self._rope = (self.rotary, RopeTable(self.rotary) if fixed_rope(self.rotary) else None)
        return self._rope[1]

    def linears(self) -> list[Linear]:
        """Every matmul of the model, the LM head last."""
        body = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return [*body, self.lm_head]

    @functools.cached_property
    def fused(self) -> bool:
        """Whether a decode step's layers run as two fused calls: every layer's matmuls hold GGUF blocks."""
        return all(is_blocks(lin) for lin in self.linears()[:-1])

    @functools.cached_property
    def layer_arguments(self) -> tuple[list[torch.Tensor], list[int]]:
        """The fused layers' weights as ``decoder_ops.LayerPlan`` takes them (only where ``fused``)."""
        return decoder_ops.layer_arguments([(layer.attn_norm, layer.qkv.blocks, layer.o.blocks, layer.mlp_norm,
                                             layer.gate_up.blocks, layer.down.blocks) for layer in self.layers])

    def check_activations(self, activations: str) -> None:
        """Raise ValueError saying why the block products cannot take ``activations`` ("float32", "int8": x
        quantized per block of 32, decoder_ops.cpp; "bf16x2": x as two bf16 limbs on AMX tiles; "int16": x quantized
        per block of 32 to int16, exact integer block dots): int8, bf16x2 and int16 need block weights (without them
        the products would not change), bf16x2 a CPU with AMX-BF16, bf16x2 and int16 every block weight's out
        features a multiple of 16 (Linear.check_activations); int16 runs on every CPU."""
        decoder_ops.activation_code(activations)  # refuses an unknown name
        blocks = [lin for lin in self.linears() if is_blocks(lin)]
        if activations != "float32" and not blocks:
            raise ValueError(f"activations={activations} needs block weights (GGUF as-stored, int4 or int8), got "
                             f"{self.weight_format}")
        if activations == "bf16x2":
            if not decoder_ops.amx_available():
                raise ValueError("activations=bf16x2 needs a CPU with AMX-BF16 (Intel Sapphire Rapids or later; "
                                 "on Linux, the kernel's permission for the AMX tiles) and the fused CPU library; "
                                 "this machine has not")
        for lin in blocks:
            lin.check_activations(activations)

    def auto_activations(self) -> tuple[str, str]:
        """What RuntimeConfig's activations "auto" resolves to, and why: ``cpu_activations()``'s pick where
        ``check_activations`` accepts it, else "float32" with the refusal."""
        activations, why = cpu_activations()
        if activations == "float32":
            return activations, why
        try:
            self.check_activations(activations)
        except ValueError as e:
            return "float32", str(e)
        return activations, f"{why} and every block weight takes it"

    def resolve_activations(self, names: list[str]) -> list[str]:
        """``names`` (RuntimeConfig activations choices) with "auto" as ``auto_activations`` resolves it, each once,
        in the order first named: what a bench that takes turns between them times."""
        auto = self.auto_activations()[0] if "auto" in names else None
        return list(dict.fromkeys(auto if a == "auto" else a for a in names))

    def set_activations(self, activations: str) -> None:
        """Every block product's activations (``check_activations`` says which it takes; checked for every weight
        before any changes)."""
        self.check_activations(activations)
        for lin in self.linears():
            if is_blocks(lin):
                lin.set_activations(activations)
        self.__dict__.pop("layer_arguments", None)  # the fused layers' weights: bf16x2's and int16's are units
        self.activations = activations

    def fused_rows(self, rows: int) -> bool:
        """Whether a forward over ``rows`` rows of x runs its layers as the fused calls on the blocks (linear.py's
        rule for the layers' wide copies, which share one dtype, and the block products' activations)."""
        return self.fused and blocks_path(rows, self.layers[0].qkv.wide_dtype, self.activations)

    def set_prefill_dtype(self, dtype: torch.dtype | None) -> None:
        """The dtype in which the quantized formats run their prefill GEMMs (linear.py's ``wide`` copies, made on
        first use or by ``hold_wide``), or None: on the blocks at every row count, no copy."""
        for lin in self.linears():
            if is_blocks(lin):
                lin.set_wide_dtype(dtype)

    def hold_wide(self) -> None:
        """Every block weight's copy made now where linear.py's rule will multiply through it, none held where it
        never will (the load's work, not the first prefill's)."""
        for lin in self.linears():
            if is_blocks(lin):
                lin.hold_wide()

    @property
    def wide_bytes(self) -> int:
        """Bytes the block weights' dequantized copies hold (beside ``weight_bytes``, which a decode step reads)."""
        return sum(lin.wide_nbytes for lin in self.linears() if is_blocks(lin))

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matmul's weights and the norms (the embedding
        row is one row, not counted)."""
        norms = self.norm.numel() + sum(layer.attn_norm.numel() + layer.mlp_norm.numel() for layer in self.layers)
        return sum(lin.nbytes for lin in self.linears()) + norms * 4

    @property
    def matmul_format(self) -> str:
        """The formats of the layers' matmuls and of the LM head, e.g. "int4, lm_head int8"."""
        body = sorted({lin.format for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)})
        return f"{'+'.join(body)}, lm_head {self.lm_head.format}"

    @property
    def weight_format(self) -> str:
        """``matmul_format`` and the block products' activations where they are not float32 ("int4, lm_head int8,
        activations int8")."""
        return self.matmul_format + shown_activations(self.activations)


def cpu_activations() -> tuple[str, str]:
    """What "auto" picks on this CPU for block weights that take every activations (out features multiples of 16,
    as the embedded model's), and why: "bf16x2" with AMX-BF16 (amx_available), else "int16" where the block
    products run at AVX-512 VNNI's level (dpwssd: faster than float32 at one row and at eight on Zen 4,
    docs/bench/history.md, 2026-12-07, helper h61), else "float32" (int16's AVX2 loop, timed on that Zen 4 only,
    was measured on no AVX2 machine). Each of the two keeps float32's greedy tokens."""
    if decoder_ops.amx_available():
        return "bf16x2", "AMX-BF16 present"
    level = decoder_ops.isa() if decoder_ops.available() else 0
    if level >= decoder_ops.ISA_NAMES.index("avx512_vnni"):
        return "int16", "no AMX-BF16, AVX-512 VNNI present"
    return "float32", (f"neither AMX-BF16 (bf16x2) nor AVX-512 VNNI (int16) at the block products' level "
                       f"({decoder_ops.ISA_NAMES[level]}; or the fused CPU library is not built)")


def shown_activations(activations: str) -> str:
    """How ``Decoder.weight_format`` ends for ``activations``: nothing for float32, ", activations NAME" else."""
    return "" if activations == "float32" else f", activations {activations}"


# Activations whose products a session moves across as if they were float32's (engine/session_artifact.py's
# model_fingerprint says why); int8's are not among them.
SAME_AS_FLOAT32 = ("bf16x2", "int16")


def compared_weight_format(weight_format: str) -> str:
    """``Decoder.weight_format`` as a session's model fingerprint compares it (what users see stays the whole
    string): the activations of SAME_AS_FLOAT32 shown as float32's are, by nothing. "int4, lm_head int8,
    activations bf16x2" -> "int4, lm_head int8"; ", activations int8" stays."""
    for name in SAME_AS_FLOAT32:
        weight_format = weight_format.removesuffix(shown_activations(name))
    return weight_format


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (N, D) float32 -> x / sqrt(mean(x^2) + eps) * weight: one loop of the fused CPU library on a CPU
    (torch's op runs as five there), torch's op elsewhere."""
    if x.device.type == "cpu" and decoder_ops.available():
        return decoder_ops.rms_norm(x, weight, eps)
    return torch.rms_norm(x, weight.shape, weight, eps)


def rope_tables(rotary: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos, sin for ``positions`` (B, T) -> each (B*T, d) float32, one row per token."""
    cos, sin = rotary(x, positions)  # (B, T, d)
    return cos.reshape(-1, cos.shape[-1]).float().contiguous(), sin.reshape(-1, sin.shape[-1]).float().contiguous()


class RopeTable:
    """``rope_tables`` of positions 0 .. n - 1 in one call of transformers' rotary embedding, grown by doubling as
    positions past n are asked for: a decode step indexes its rows (``rows``) instead of calling the embedding
    (a dozen tensor ops and the module's call for one position a row). The embedding is elementwise in the
    position (position x inverse frequency, then cos and sin), so a row equals ``rope_tables`` of that position
    alone bit for bit. Only for a RoPE type whose frequencies stay fixed (``fixed_rope``)."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        self.rotary = rotary
        self.cos = self.sin = None  # (n, d) float32 each

    def rows(self, x: torch.Tensor, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (N,) int64 -> cos, sin (N, d) float32; x: the forward's residual stream (its device, dtype);
        top: max(positions), from the caller's host-side lengths (reading it from the device would sync a GPU)."""
        if self.cos is None or top >= self.cos.shape[0]:
            n = max(256, top + 1, 2 * (0 if self.cos is None else self.cos.shape[0]))
            self.cos, self.sin = rope_tables(self.rotary, x, torch.arange(n, device=x.device).view(1, n))
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def fixed_rope(rotary: torch.nn.Module) -> bool:
    """Whether ``rotary``'s frequencies are fixed: transformers recomputes "dynamic" and "longrope" ones from the
    longest position it is given, so a table made ahead would differ."""
    kind = getattr(rotary, "rope_type", None)
    return isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x (N, heads, d) rotated in place: x cos + rotate_half(x) sin with rotate_half(x) = (-x2, x1), transformers'
    RoPE, in one loop of the fused CPU library on a CPU."""
    if x.device.type == "cpu" and decoder_ops.available():
        decoder_ops.rope_(x, cos, sin)
        return
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    x.copy_(x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1))


def layer_step(layer: LayerWeights, dec: Decoder, index: int, x: torch.Tensor, shape: tuple[int, int],
               cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
    """One decoder layer on x (B*T, D) -> the new residual stream (B*T, D), which may be x itself updated in place
    (the caller reads x only through the result)."""
    B, T = shape
    H, H_kv, d = dec.num_heads, dec.num_kv_heads, dec.head_dim
    fused = dec.fused_rows(B * T)
    if fused:
        qkv = decoder_ops.attn_in(x, layer.attn_norm, dec.eps, layer.qkv.blocks, cos, sin, H + H_kv, d,
                                  dec.activations)
    else:
        qkv = layer.qkv(rms_norm(x, layer.attn_norm, dec.eps))
        rope_(qkv.view(B * T, H + 2 * H_kv, d)[:, :H + H_kv], cos, sin)  # q and k rotated together
    heads = qkv.view(B, T, H + 2 * H_kv, d).transpose(1, 2)  # (B, H + 2 H_kv, T, d)
    out = attend(index, heads[:, :H], heads[:, H:H + H_kv], heads[:, H + H_kv:], 1.0 / math.sqrt(d))  # (B, H, T, d)
    a = out.transpose(1, 2).reshape(B * T, H * d)
    if fused:
        return decoder_ops.mlp_out(x, a, layer.o.blocks, layer.mlp_norm, dec.eps, layer.gate_up.blocks,
                                   layer.down.blocks, dec.activations)
    x = layer.o(a, residual=x, into=True)
    # (B*T, F) each, float32 or the wide copy's bfloat16: widened where read (exactly), not copied whole first
    gate, up = layer.gate_up(rms_norm(x, layer.mlp_norm, dec.eps), widen=False).chunk(2, dim=-1)
    return layer.down(F.silu(gate.float(), inplace=True).mul_(up), residual=x, into=True)


def forward(dec: Decoder, ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
            layers: Layers | None = None, logits_at: list[int] | None = None,
            top_position: int | None = None) -> torch.Tensor | None:
    """ids, positions (B, T) int64 -> float32 logits (B, V) after each row's last token. ``layers``: the
    layers in one call (a decode step's whole-step kernel), else one ``layer_step`` each with ``attend``.
    ``logits_at``: instead, the logits (len, V) at these indices of the B*T tokens (a ragged prefill's
    prompts that end in it; None when the list is empty: the LM head is skipped). ``top_position``: a decode
    step's largest position, known on the host: its RoPE rows then come from the decoder's kept table."""
    B, T = ids.shape
    x = dec.embed(ids.reshape(-1))  # (B*T, D) float32, a new tensor: the layers may update it in place
    table = dec.rope_table() if T == 1 and top_position is not None else None  # a decode step: the kept table's rows
    if table is not None:
        cos, sin = table.rows(x, positions.view(-1), top_position)
    else:
        cos, sin = rope_tables(dec.rotary, x, positions)
    if layers is not None:
        x = layers(x, cos, sin)
    else:
        for index, layer in enumerate(dec.layers):
            x = layer_step(layer, dec, index, x, (B, T), cos, sin, attend)
    if logits_at is None:  # (B, D); a decode step's x is that already (and contiguous): no view, no copy
        last = x if T == 1 else x.view(B, T, -1)[:, -1].contiguous()
    elif not logits_at:
        return None
    else:
        last = x[logits_at]  # (len, D)
    return dec.lm_head(rms_norm(last, dec.norm, dec.eps))  # (rows, V)
