"""A CPU tensor reserved once at its largest size, used as a growing prefix: growth is a wider view, no copy.

``ReservedRows(rows, row_shape, dtype)`` maps ``rows`` rows of ``row_shape`` as private anonymous memory
(``mmap``): the kernel commits a page only when it is first written, and an untouched page reads as zero. So
``view(n)``, the tensor's first n rows, grows to any n <= rows without copying the rows in use and without
zero-filling the new ones (rows never used read as zero, as a freshly zeroed tensor's; rows used before and
given back read as zero but for the page they share with the last row kept, which keeps what it held), and the
view's storage never moves: whoever holds a view of the first rows keeps seeing them after a growth.
``release(n)`` gives the pages wholly in rows n and above back to the system (``madvise(MADV_DONTNEED)``) once
the view no longer covers them.

The reservation is address space, not memory: the KV pool (kv_pool.py) reserves what its budget could ever hold
and is charged for the rows it views. It is mapped MAP_NORESERVE, so the kernel's overcommit accounting does
not charge it either: without the flag a process holding a few such pools (adjacent ones merge into one
mapping) could no longer fork(), whose copy of the address space is charged mapping by mapping, once one
mapping outgrew the machine's memory. Where the system refuses the reservation (a strict overcommit policy,
``vm.overcommit_memory=2``, charges it anyway) ``reserve`` returns None and the caller grows by copying instead.
"""

from __future__ import annotations

import math
import mmap
import platform
import sys

import torch

PAGE = mmap.PAGESIZE
# mmap.MAP_NORESERVE is Python 3.12's; 0x4000 is Linux's value on x86-64 and arm64 (elsewhere: no flag).
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux")
                        and platform.machine() in ("x86_64", "aarch64") else 0)


class ReservedRows:
    """See the module docstring."""

    def __init__(self, rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.rows, self.row_shape = rows, tuple(row_shape)
        self.row_nbytes = math.prod(self.row_shape) * torch.empty((), dtype=dtype).element_size()
        self._map = mmap.mmap(-1, max(1, rows * self.row_nbytes),
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # as torch's allocator asks (retopk_core/hugepages.py): fewer TLB misses
            self._map.madvise(mmap.MADV_HUGEPAGE)
        with torch.inference_mode(False):  # a pool made outside inference mode stays writable outside it
            self.base = torch.frombuffer(self._map, dtype=dtype, count=rows * math.prod(self.row_shape)) \
                .view(rows, *self.row_shape)  # (rows, *row_shape)

    def view(self, n: int) -> torch.Tensor:
        """The first ``n`` rows: (n, *row_shape), a view of the reservation (contiguous)."""
        if not 0 <= n <= self.rows:
            raise ValueError(f"{n} rows exceed the {self.rows} reserved")
        with torch.inference_mode(False):
            return self.base[:n]

    def release(self, n: int) -> None:
        """Give back the pages that lie wholly in rows ``n`` and above (they read as zero afterwards)."""
        start = -(-n * self.row_nbytes // PAGE) * PAGE
        end = len(self._map) // PAGE * PAGE
        if start < end:
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)


def reserve(rows: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> ReservedRows | None:
    """A reservation of ``rows`` rows, or None where the system refuses the address space (module docstring)."""
    try:
        return ReservedRows(rows, row_shape, dtype)
    except (OSError, ValueError, OverflowError):
        return None
