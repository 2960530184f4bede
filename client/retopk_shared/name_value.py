"""The one ``name=value`` grammar of hyperparameters on every command line (client, server, benchmarks).

    "top_k=64,tau=0.9,retrieval=recent"  ->  {"top_k": 64, "tau": 0.9, "retrieval": "recent"}

Items are separated by ``sep`` ("," unless the caller's own syntax uses commas: the evaluation scripts'
``--methods full,retopk:tau=0.9+window=64`` separates with "+"); blanks around names and values are
dropped; a value is an int, else a float, else true/false (any case), else the string itself. Torch-free,
so the client's command line uses it too; errors are ValueError naming the bad item.
"""

from __future__ import annotations


def parse_value(text: str) -> int | float | bool | str:
    """A hyperparameter value: int, float, bool (true/false) or else the string itself."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_params(text: str, sep: str = ",") -> dict:
    """``"top_k=64,tau=0.9"`` -> ``{"top_k": 64, "tau": 0.9}`` (``""`` -> ``{}``)."""
    params = {}
    for item in filter(None, (part.strip() for part in text.split(sep))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"expected NAME=VALUE[{sep}NAME=VALUE...], got {item!r}")
        params[key.strip()] = parse_value(value)
    return params


def format_params(params: dict, sep: str = ",") -> str:
    """The inverse of ``parse_params`` for the values it produces."""
    return sep.join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())
