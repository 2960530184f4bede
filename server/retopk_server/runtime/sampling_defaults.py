"""The sampling a request gets for each field it leaves unset: the model's generation config, else chat defaults.

  1. the checkpoint's generation config (generation_config.json), when it sets any of SAMPLING_KEYS: the
     fields it sets, as vLLM reads them (``do_sample`` is not read: a request asks for greedy with
     temperature 0);
  2. else CHAT_DEFAULTS, retopk's own: temperature 0.7 and top_p 0.9, common chat settings (Qwen2's and
     Llama-2-chat's generation configs use 0.6-0.7 and 0.8-0.9). The embedded SmolLM2-135M-Instruct is a
     GGUF file without a generation config, so it gets these. (Its model card's usage example samples at
     temperature 0.2, top_p 0.9; asked for a story on a second chat turn, it repeated itself at 0.2 in 3
     of 4 seeded runs, distinct 4-grams 0.23-0.68, and at 0.7 in none of 2, 0.98-0.99; greedy: 0.29.)
Fields the source does not name keep SamplingParams' neutral values (top_k 0, min_p 0, penalties off).
A request that sets a field overrides only that field; temperature 0 stays greedy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from retopk_core.params import ParamError
from retopk_server.runtime.sampling import SamplingParams

log = logging.getLogger("retopk_server.runtime")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
CHAT_DEFAULTS = (("temperature", 0.7), ("top_p", 0.9))
CHAT_DEFAULTS_SOURCE = "retopk chat defaults (no generation config)"

Defaults = tuple[tuple[str, float | int], ...]


def _valid(key: str, value) -> bool:
    try:
        SamplingParams(**{key: value})
    except (ParamError, TypeError):
        return False
    return True


def from_generation_config(generation_config) -> Defaults:
    """The sampling fields a transformers GenerationConfig sets (transformers 5 leaves unset ones None);
    a value SamplingParams refuses is skipped with a warning rather than failing the server."""
    out = []
    for key in SAMPLING_KEYS:
        value = getattr(generation_config, key, None) if generation_config is not None else None
        if value is None:
            continue
        value = int(value) if key == "top_k" else float(value)
        if _valid(key, value):
            out.append((key, value))
        else:
            log.warning("generation config: ignoring %s=%r (out of range for retopk's sampler)", key, value)
    return tuple(out)


def model_defaults(generation_config) -> tuple[Defaults, str]:
    """(defaults, where they come from) for a model: see the module docstring for the order."""
    if found := from_generation_config(generation_config):
        return found, "the model's generation config"
    return CHAT_DEFAULTS, CHAT_DEFAULTS_SOURCE


def resolve(given: Mapping[str, object], defaults: Defaults) -> SamplingParams:
    """A request's SamplingParams: its given fields over the defaults (ParamError names a bad given field)."""
    return SamplingParams(**{**dict(defaults), **given})


def resolved_fields(defaults: Defaults) -> dict[str, float | int]:
    """Every field but seed as an unset request gets it (for ModelInfo.default_sampling)."""
    params = resolve({}, defaults)
    return {key: getattr(params, key) for key in SamplingParams.__dataclass_fields__ if key != "seed"}
