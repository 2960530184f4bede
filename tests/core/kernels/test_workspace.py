"""Workspace: views of grow-only buffers; reallocation only when a request outgrows a buffer."""

from __future__ import annotations

import torch

from retopk_core.kernels.workspace_cache import Workspace, WorkspaceCache


def test_views_reuse_buffers_and_grow_geometrically():
    ws = Workspace("cpu")
    a = ws.get("scores", (2, 3, 100), torch.float32)
    assert a.shape == (2, 3, 100) and a.is_contiguous() and ws.allocations == 1
    b = ws.get("scores", (1, 3, 50), torch.float32)  # smaller: same storage, no allocation
    assert ws.allocations == 1 and b.data_ptr() == a.data_ptr()
    ws.get("scores", (2, 3, 101), torch.float32)  # L grew: one reallocation, to at least twice the size
    assert ws.allocations == 2
    for L in range(102, 200):  # a sequence growing token by token fits in the doubled buffer
        ws.get("scores", (2, 3, L), torch.float32)
    assert ws.allocations == 2
    ws.get("scores", (2, 3, 100), torch.int64)  # another dtype: its own buffer
    assert ws.allocations == 3 and ws.nbytes() > 0


def test_cache_shares_one_workspace_per_device():
    cache = WorkspaceCache()
    assert cache.shared("cpu") is cache.shared(torch.device("cpu"))
