"""Bounds of an imported session's method state (``AttentionMethod.check_state``): each check raises ValueError
naming the field, "method state: <field> ...". Tensors are a field's values over every layer. A state's bulk is
bounded by its extremes (one pass of ``torch.aminmax``, which propagates NaN), not by a mask of every value."""

from __future__ import annotations

import math

import torch


def require(tensors: dict[str, torch.Tensor], fields: tuple[str, ...]) -> None:
    """Every one of ``fields`` is present."""
    for name in fields:
        if name not in tensors:
            raise ValueError(f"method state: field {name!r} is missing")


def integers_within(tensors: dict[str, torch.Tensor], name: str, lo: int, hi: int, what: str = "") -> None:
    """``tensors[name]`` is int64, or int32 (a saved session's file keeps an int64 field whose values fit it so:
    the copy into the pool widens it, ``SlotPool.write_slot``), with every value in [lo, hi] (``what`` says what
    the bounds are)."""
    t = tensors[name]
    ok = t.dtype in (torch.long, torch.int32)
    if ok and t.numel():
        low, high = (int(end) for end in torch.aminmax(t))  # Python ints: an int32 tensor would wrap ``hi``
        ok = lo <= low and high <= hi
    if not ok:
        raise ValueError(f"method state: {name} must be int64 (or int32) in [{lo}, {hi}]"
                         f"{f' ({what})' if what else ''}")


def finite(tensors: dict[str, torch.Tensor], *names: str) -> None:
    """Each of ``names`` holds finite floating-point values."""
    for name in names:
        t = tensors[name]
        if not t.is_floating_point() or (t.numel() and not all(map(math.isfinite, torch.aminmax(t)))):
            raise ValueError(f"method state: {name} must be finite floating-point values")


def flags(tensors: dict[str, torch.Tensor], *names: str) -> None:
    """Each of ``names`` is a bool tensor."""
    for name in names:
        if tensors[name].dtype != torch.bool:
            raise ValueError(f"method state: {name} must be bool")


def extent(tensors: dict[str, torch.Tensor], name: str, dim: int, want: int, what: str) -> None:
    """``tensors[name]``'s dimension ``dim`` (of the per-layer stack) is ``want`` long: a pool grows to it on
    import, so it is bounded by what the session's tokens need."""
    t = tensors[name]
    if t.dim() <= dim or t.shape[dim] != want:
        raise ValueError(f"method state: {name} must hold {want} {what}, got shape {tuple(t.shape)}")
