"""Attention methods of the core, all following ``base.AttentionMethod``; build them by name with
``registry.make_method``."""

from retopk_core.methods.base import AttentionMethod, Path, SlotPool, StepOutput
from retopk_core.methods.registry import make_method, method_names, register

__all__ = ["AttentionMethod", "Path", "SlotPool", "StepOutput", "make_method", "method_names", "register"]
