"""Loading a model for the runner: its config, tokenizer and generation defaults, and its weights as a Decoder
in the chosen format (decoder/load.py); extending its RoPE context.

A GGUF file is read directly (its quantized tensors kept as stored, or converted); a checkpoint directory
goes through transformers' from_pretrained first. Nothing is downloaded: every read is local_files_only.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from retopk_server.runtime.decoder.llama import Decoder
from retopk_server.runtime.decoder.load import from_gguf, from_transformers, rotary_for

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    decoder: Decoder
    tokenizer: object | None
    config: object  # the transformers PretrainedConfig (RoPE scaling applied)
    generation_config: object | None
    architecture: str  # e.g. "LlamaForCausalLM"


def architecture_of(config) -> str:
    names = getattr(config, "architectures", None) or []
    if names:
        return str(names[0])
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        config.model_type, config.model_type)


def with_rope_scaling(config, rope_scaling: dict | None):
    """A copy of ``config`` whose RoPE parameters are updated by ``rope_scaling`` (rope_theta kept)."""
    config = copy.deepcopy(config)
    if rope_scaling is None:
        return config
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(rope_scaling)
    if params.get("rope_type") in ("yarn", "longrope", "llama3"):
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    config.rope_parameters = params
    return config


def load(name: str, weights: str, rope_scaling: dict | None = None) -> LoadedModel:
    """The model ``name`` (an embedded name, a checkpoint directory or a .gguf file) with its weights in
    format ``weights``; ModelNotFoundError (retopk_core.models) when it is not on this machine."""
    from transformers import AutoConfig, GenerationConfig

    from retopk_core.models import resolve_model

    source = resolve_model(name)
    kwargs = {"local_files_only": True}
    started = time.perf_counter()
    if source.gguf_file is None:
        from retopk_core.models import load_model

        log.info("loading checkpoint %s with transformers", source.path)
        model, tokenizer = load_model(name)
        config = with_rope_scaling(model.config, rope_scaling)
        decoder = from_transformers(model, weights)
        generation = getattr(model, "generation_config", None)
        del model
    else:
        kwargs["gguf_file"] = source.gguf_file
        log.info("reading %s: config and tokenizer", source.gguf_file)
        config = with_rope_scaling(AutoConfig.from_pretrained(source.path, **kwargs), rope_scaling)
        tokenizer = gguf_tokenizer(Path(source.path) / source.gguf_file)
        log.info("reading %s: weights (%s)", source.gguf_file, weights)
        decoder = from_gguf(str(Path(source.path) / source.gguf_file), config, weights)
        generation = GenerationConfig.from_model_config(config)
    decoder.rotary = rotary_for(config)
    log.info("model loaded in %.1f s: %s weights, %.1f MB read per decode step", time.perf_counter() - started,
             decoder.weight_format, decoder.weight_bytes / 1e6)
    return LoadedModel(decoder, tokenizer, config, generation, architecture_of(config))


def from_model(model, weights: str, rope_scaling: dict | None = None) -> LoadedModel:
    """A LoadedModel over an already loaded transformers causal LM (tests, the evaluation)."""
    config = with_rope_scaling(model.config, rope_scaling)
    decoder = from_transformers(model, weights)
    decoder.rotary = rotary_for(config)
    return LoadedModel(decoder, None, config, getattr(model, "generation_config", None), type(model).__name__)



def tokenizer_cache(gguf: Path) -> Path:
    """Where the tokenizer converted from ``gguf`` is kept: $XDG_CACHE_HOME (or ~/.cache)/retopk/tokenizers/,
    keyed by the file's path, size and modification time."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "retopk" / "tokenizers" / key


def gguf_tokenizer(gguf: Path):
    """The tokenizer of a GGUF file. transformers builds it from the file's vocabulary and merges, which takes
    most of a start for a large vocabulary (SmolLM2's 49K tokens); the result is saved once and read back after."""
    from transformers import AutoTokenizer

    cache = tokenizer_cache(gguf)
    if (cache / "tokenizer.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - a damaged cache is rebuilt below
            log.warning("tokenizer cache %s unreadable (%s): converting the GGUF's vocabulary again", cache, e)
    log.info("converting the tokenizer of %s (once; kept in %s)", gguf.name, cache)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.replace(cache)  # one rename: a concurrent start reads no half-written folder
    except OSError as e:  # a read-only home, or another start renamed first: convert on every start / use theirs
        log.warning("could not keep the converted tokenizer in %s: %s", cache, e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
