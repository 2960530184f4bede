"""Methods by name, so the server, the evaluation and the benchmarks switch methods with a string."""

from __future__ import annotations

import importlib

from retopk_core.methods.base import AttentionMethod
from retopk_core.params import ParamError

# The methods a server offers, name -> "module:class"; the class's ``config_class`` declares its hyperparameters.
_METHODS: dict[str, str] = {
    "full": "retopk_core.methods.full:FullAttention",
    "exact_topk": "retopk_core.methods.exact:ExactTopK",
    "retopk": "retopk_core.methods.retopk:ReTopK",
    "streaming_llm": "retopk_core.methods.baselines.streaming_llm:StreamingLLM",
    "quest": "retopk_core.methods.baselines.quest:Quest",
    "sparq": "retopk_core.methods.baselines.sparq:SparQ",
    "loki": "retopk_core.methods.baselines.loki:Loki",
    "tokenselect": "retopk_core.methods.baselines.tokenselect:TokenSelect",
}
# Evaluation wrappers (``methods/probe.py``'s fidelity_probe registers itself when the evaluation imports it):
# built by name in-process like any method, never offered by a server.
_EVALUATION: dict[str, str] = {}


def register(name: str, target: str, serving: bool = True) -> None:
    """Add a method: ``target`` is "module:class", an AttentionMethod subclass; ``serving`` False for an
    evaluation wrapper, which ``serving_method_names`` leaves out."""
    (_METHODS if serving else _EVALUATION)[name] = target


def method_names() -> list[str]:
    return sorted(_METHODS | _EVALUATION)


def serving_method_names() -> list[str]:
    """The methods a server offers: the registered ones but the evaluation wrappers."""
    return sorted(_METHODS)


def method_class(name: str) -> type[AttentionMethod]:
    """The class registered under ``name``; an unknown name is a ParamError on field "name"."""
    try:
        target = (_METHODS | _EVALUATION)[name]
    except KeyError:
        raise ParamError("name", f"unknown method {name!r}; choose one of {', '.join(method_names())}") from None
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def make_method(name: str, backend: str = "torch", **params) -> AttentionMethod:
    """Build a method by name from its keyword hyperparameters (the fields of its config).

    Unknown names and bad hyperparameters raise ``ParamError`` (a ValueError) whose ``field`` names them.
    """
    cls = method_class(name)
    if cls.config_class is None:  # a wrapper with keywords of its own (fidelity_probe)
        try:
            return cls(backend=backend, **params)
        except TypeError as e:
            raise ParamError("params", f"bad parameters for method {name!r}: {e}") from None
    return cls(cls.config_class.from_params(params, name), backend=backend)
