"""Grow-only scratch buffers reused across decode steps, one per name: the torch path's and the kernels'.

A fresh multi-MB tensor costs page faults on every step; a reused one has its pages mapped already. A
buffer is reallocated only when a request is larger than it, or of another dtype, device or inference
mode (an inference tensor cannot be written outside inference mode), and then to at least twice its old
size, so a sequence that grows token by token reallocates O(log L) times. ``allocations`` counts
reallocations (tests check it stays flat across decode steps). Views handed out are overwritten by the
next request of the same name: not thread-safe, one decode at a time per workspace.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """Named flat buffers; ``device`` is the default of ``get`` (``take`` names its device)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = None if device is None else torch.device(device)
        self._bufs: dict[str, torch.Tensor] = {}
        self.allocations = 0

    def take(self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A flat buffer of at least ``numel`` elements (contents undefined) -> its first numel."""
        buf = self._bufs.get(name)
        if (buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != torch.device(device)
                or buf.is_inference() != torch.is_inference_mode_enabled()):
            grow = 2 * buf.numel() if buf is not None and buf.dtype == dtype else 0
            buf = torch.empty(max(numel, grow, 1), dtype=dtype, device=device)
            self._bufs[name] = buf
            self.allocations += 1
        return buf[:numel]

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous (uninitialised) view of ``shape`` on buffer ``name``, on the workspace's device."""
        return self.take(name, math.prod(shape), dtype, self.device).view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())
