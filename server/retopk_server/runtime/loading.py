"""Loading a causal LM and its tokenizer by name or path, and extending its RoPE context."""

from __future__ import annotations

import torch


def load(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer) for an embedded model name or a local checkpoint folder / .gguf file.

    Nothing is downloaded; an unknown name or missing files raise retopk_core.models.ModelNotFoundError.
    """
    from retopk_core.models import load_model

    return load_model(name, dtype=dtype, device=device)


def apply_rope_scaling(model, rope_scaling: dict) -> None:
    """Replace the model's RoPE parameters (keeping rope_theta) and rebuild its rotary embedding."""
    config = model.config
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(rope_scaling)
    if params.get("rope_type") in ("yarn", "longrope", "llama3"):
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    config.rope_parameters = params
    base = model.base_model
    old = base.rotary_emb
    base.rotary_emb = type(old)(config=config).to(old.inv_freq.device)
