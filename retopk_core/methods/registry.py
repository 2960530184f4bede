"""Methods by name, so the server, the evaluation and the benchmarks switch methods with a string."""

from __future__ import annotations

import importlib

from retopk_core.methods.base import AttentionMethod

# name -> "module:factory"; the factory takes the method's keyword hyperparameters.
_METHODS: dict[str, str] = {
    "full": "retopk_core.methods.full:FullAttention",
    "exact_topk": "retopk_core.methods.exact:ExactTopK",
    "retopk": "retopk_core.methods.retopk:ReTopK",
    "streaming_llm": "retopk_core.methods.baselines.streaming_llm:StreamingLLM",
    "quest": "retopk_core.methods.baselines.quest:Quest",
    "sparq": "retopk_core.methods.baselines.sparq:SparQ",
    "loki": "retopk_core.methods.baselines.loki:Loki",
    "tokenselect": "retopk_core.methods.baselines.tokenselect:TokenSelect",
    "fidelity_probe": "retopk_core.methods.probe:FidelityProbe",  # evaluation: wraps a method, measures it
}


# Evaluation wrappers: the benchmarks build them in-process; a server never offers them to clients.
_EVALUATION_ONLY = frozenset({"fidelity_probe"})


def register(name: str, target: str) -> None:
    """Add a method: ``target`` is "module:callable" taking keyword hyperparameters."""
    _METHODS[name] = target


def method_names() -> list[str]:
    return sorted(_METHODS)


def serving_method_names() -> list[str]:
    """The methods a server offers: every registered one except the evaluation wrappers."""
    return [name for name in method_names() if name not in _EVALUATION_ONLY]


def make_method(name: str, **params) -> AttentionMethod:
    """Build a method by name; unknown names and bad hyperparameters raise ValueError."""
    try:
        target = _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(method_names())}") from None
    module, attr = target.split(":")
    factory = getattr(importlib.import_module(module), attr)
    try:
        return factory(**params)
    except TypeError as e:  # an unexpected keyword: name it for the caller
        raise ValueError(f"bad parameters for method {name!r}: {e}") from None
