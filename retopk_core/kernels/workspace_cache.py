"""Which ``Workspace`` (retopk_core/workspace.py) a kernel launcher takes its scratch from, so that the
decode loop allocates no scratch.

Ownership: every launcher takes its scratch from one workspace per (device, CUDA stream)
(``WorkspaceCache.shared``): scratch is consumed within one launcher call, so the layers of a model
(and the methods) can share it; per-layer workspaces would multiply the largest buffer, the exact
path's (B, H, L_cap) float32 scores, by the number of layers. Results handed back to the caller are
always fresh tensors, never views of a workspace.
"""

from __future__ import annotations

import torch

from retopk_core.workspace import Workspace


class WorkspaceCache:
    """One workspace per (device, CUDA stream)."""

    def __init__(self) -> None:
        self._by_device: dict[str, Workspace] = {}

    def shared(self, device: torch.device) -> Workspace:
        device = torch.device(device)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = f"{device}/{stream}"
        if key not in self._by_device:
            self._by_device[key] = Workspace(device)
        return self._by_device[key]

    def clear(self) -> None:
        self._by_device.clear()


# The process's scratch cache used by triton_launch.py (explicit, inspectable, clear()-able).
WORKSPACES = WorkspaceCache()
