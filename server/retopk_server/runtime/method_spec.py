"""A hashable description of an attention method (name + hyperparameters), so sessions can be grouped by it."""

from __future__ import annotations

from dataclasses import dataclass

from retopk_core.methods.base import AttentionMethod
from retopk_core.methods.registry import make_method, method_class


@dataclass(frozen=True)
class MethodSpec:
    """Method name from ``retopk_core.methods.registry`` and its keyword hyperparameters.

    ``params`` is a sorted tuple of (name, value) pairs so that equal specs hash equally and the runner
    can share one method instance (and its per-layer state pools) between sessions with the same spec.
    """

    name: str = "retopk"
    params: tuple[tuple[str, object], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        try:
            params = tuple(sorted((str(k), v) for k, v in self.params))
        except (TypeError, ValueError):
            raise ValueError(f"params must be (name, value) pairs, got {self.params!r}") from None
        if len({k for k, _ in params}) != len(params):
            raise ValueError(f"params repeats a name: {params!r}")
        try:
            hash(params)
        except TypeError:
            raise ValueError(f"params values must be hashable (numbers, strings), got {params!r}") from None
        object.__setattr__(self, "params", params)

    @classmethod
    def of(cls, name: str, **params) -> MethodSpec:
        return cls(name, tuple(params.items()))

    def build(self, backend: str = "torch", **defaults) -> AttentionMethod:
        """The method object on ``backend``; ``defaults`` apply to the config fields the spec does not set.

        A default that is not a field of the method's config is dropped; unknown names and bad
        hyperparameters of the spec itself raise ``retopk_core.params.ParamError`` naming the field.
        """
        config_class = method_class(self.name).config_class
        fields = config_class.names() if config_class is not None else ()
        params = dict(self.params)
        params.update({k: v for k, v in defaults.items() if k in fields and k not in params})
        return make_method(self.name, backend=backend, **params)

    def describe(self) -> dict:
        return {"method": self.name, **dict(self.params)}
