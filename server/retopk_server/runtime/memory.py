"""MemoryUsage: the cache bytes a runner holds, as the metrics report them."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_freed_memory() -> None:
    """Hand the C allocator's free memory back to the system (glibc's malloc_trim; elsewhere nothing): torch
    frees a CPU tensor into malloc, which keeps what is below its mmap threshold, so after pools shrink the
    process's resident size would otherwise stay at its peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class MemoryUsage:
    """kv_*: key/value blocks; method_state_*: the methods' per-session state (ReTopK's FIFOs).

    *_used: held by open sessions; *_reserved: allocated by the runner's pools (used or free);
    budget: the bytes both pools may reserve together (``RuntimeConfig.kv_cache_bytes``; 0: unknown).
    prefix_cache_*: the KV blocks the prefix cache holds (runtime/prefix_cache.py), whether sessions share
    them or not; of them *_idle_bytes held by the cache alone (reserved, not used: eviction gives them back).
    """

    kv_used: int = 0
    kv_reserved: int = 0
    method_state_used: int = 0
    method_state_reserved: int = 0
    budget: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_bytes: int = 0
    prefix_cache_idle_bytes: int = 0

    @property
    def used(self) -> int:
        return self.kv_used + self.method_state_used

    @property
    def utilization(self) -> float:
        """Share (0..1) of the budget held by sessions (KV blocks and method-state slots)."""
        return min(1.0, self.used / self.budget) if self.budget else 0.0
