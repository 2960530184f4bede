"""Hyperparameters as data: each field declared once, with its default, its doc and its bounds.

A method's config is a frozen dataclass deriving from ``MethodConfig`` whose fields are declared with
``param(default, doc, low=..., high=..., choices=...)``. That declaration is the single definition of the
parameter: construction validates every field against it (``check``), ``MethodConfig.from_params``
refuses names that are not fields, ``describe()`` lists the fields, and the server's command line and wire
conversion read the same fields. Every failure is a ``ParamError`` whose ``field`` names the bad parameter
as data, so no caller parses message text. ``check_int`` and ``check_number`` are the same checks for
configs that are not methods' (the server's runtime and sampling configs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass


class ParamError(ValueError):
    """A bad parameter; ``field`` is its name (the message names it too, for people)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def param(default, doc: str, *, low: float | None = None, high: float | None = None,
          choices: tuple[str, ...] | None = None, context: bool = False):
    """A config field: its default, one line of doc, inclusive bounds (numbers) or the allowed strings.

    ``context=True``: the field counts positions or cache entries (a Top-K, a window, a FIFO capacity,
    a refresh period), so no value above the context length of the model the method runs on means
    anything more: ``check_context`` bounds it there (a server knows the context; the core alone does not).
    """
    return dataclasses.field(default=default, metadata={"doc": doc, "low": low, "high": high, "choices": choices,
                                                        "context": context})


def check_int(name: str, value, low: int | None = 1, optional: bool = False) -> None:
    """ParamError unless value is an integer >= low (None too when optional); bools are not integers."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        kinds = {1: "a positive integer", 0: "a non-negative integer", None: "an integer"}
        kind = kinds.get(low, f"an integer >= {low}")
        raise ParamError(name, f"{name} must be {kind}{' or None' if optional else ''}, got {_short(value)}")


def check_number(name: str, value, low: float | None = None, high: float | None = None) -> None:
    """ParamError unless value is a finite number (not NaN or infinite, not a bool) within [low, high]."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = number and (isinstance(value, int) or math.isfinite(value))
    if ok and low is not None:
        ok = value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        bounds = f"lie in [{_num(low)}, {_num(high)}]" if low is not None and high is not None else (
            f"be >= {_num(low)}" if low is not None else f"be <= {_num(high)}" if high is not None else "be a number")
        if number and not isinstance(value, int) and not math.isfinite(value):
            bounds = "be a finite number" + (bounds[2:] if bounds.startswith("be >") or bounds.startswith("be <")
                                             else f" and {bounds}" if bounds != "be a number" else "")
        raise ParamError(name, f"{name} must {bounds}, got {_short(value)}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _kind(annotation) -> tuple[str, bool]:
    """("int" | "float" | "bool" | "str", optional) from a field's annotation ("int | None", float, ...)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in text.split("|")]
    optional = "None" in parts
    kinds = [p for p in parts if p != "None"]
    return (kinds[0] if len(kinds) == 1 else "any"), optional


def check(config) -> None:
    """Validate every field of a dataclass against its declaration (annotation and ``param`` metadata)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind, optional = _kind(f.type)
        meta = f.metadata
        if optional and value is None:
            continue
        if kind == "int":
            check_int(f.name, value, meta.get("low"), optional)
            if meta.get("high") is not None and value > meta["high"]:
                raise ParamError(f.name, f"{f.name} must be <= {meta['high']}, got {value!r}")
        elif kind == "float":
            check_number(f.name, value, meta.get("low"), meta.get("high"))
        elif kind == "bool" and not isinstance(value, bool):
            raise ParamError(f.name, f"{f.name} must be a bool, got {_short(value)}")
        elif kind == "str" and meta.get("choices") and value not in meta["choices"]:
            raise ParamError(f.name, f"{f.name} must be one of {', '.join(meta['choices'])}, got {_short(value)}")


def check_context(config, max_context: int, keep: Mapping[str, object] | None = None) -> None:
    """ParamError naming the first field declared with ``context=True`` whose value exceeds ``max_context``.

    A field at its declared default, or at its value in ``keep`` (a server's own default method), passes:
    those are the method's choices and mean the same at any context (a Top-K beyond the sequence attends
    to all of it); the bound is for what a caller picks.
    """
    keep = keep or {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if value == f.default or (f.name in keep and value == keep[f.name]):
            continue
        if f.metadata.get("context") and isinstance(value, int) and value > max_context:
            raise ParamError(f.name, f"{f.name} must be <= {max_context} (the model's context length), got {value}")


def _short(value, limit: int = 60) -> str:
    """repr(value), cut to about ``limit`` characters (error messages quote what a client sent)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class MethodConfig:
    """Base of every method's config: validated on construction; ``validate`` adds checks across fields."""

    def __post_init__(self) -> None:
        check(self)
        self.validate()

    def validate(self) -> None:
        """Constraints between fields (raise ``ParamError`` naming the field at fault)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def docs(cls) -> dict[str, str]:
        """Each field's one-line doc, in declaration order."""
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    @classmethod
    def from_params(cls, params: Mapping[str, object], method: str = ""):
        """The config of these keyword hyperparameters; a name that is not a field is a ParamError."""
        for key in params:
            if key not in cls.names():
                takes = ", ".join(cls.names()) or "none"
                raise ParamError(key, f"bad parameters for method {method!r}: unknown hyperparameter {key!r} "
                                      f"(it takes {takes})")
        return cls(**params)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
