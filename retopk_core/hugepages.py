"""Transparent huge pages for PyTorch's CPU allocator, for the gathers of sparse attention.

A reuse step gathers a few hundred random key/value rows per head from a cache of up to millions of
rows. With 4 KiB pages nearly every row costs a TLB miss, so the gather slows down as the cache
grows even though the work does not (docs/bench/history.md measures the reuse step with and without them).
PyTorch asks the kernel for huge pages (madvise) when THP_MEM_ALLOC_ENABLE=1, which its allocator
reads once, at its first allocation: call this before torch is imported. Linux only; elsewhere, or
with THP disabled system-wide, it changes nothing. An explicit THP_MEM_ALLOC_ENABLE is respected.
"""

from __future__ import annotations

import os
import sys


def enable_transparent_hugepages() -> bool:
    """Ask for huge-page CPU allocations; returns False when torch was imported too early for it."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    return "torch" not in sys.modules
