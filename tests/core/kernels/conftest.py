"""Kernel tests: on a machine without CUDA the Triton kernels run under the CPU interpreter.

TRITON_INTERPRET must be set before triton is imported (kernels are defined when
retopk_core.kernels.triton_launch is first imported), so it is set here at module import, and only when no
GPU is present: on a GPU machine the same tests run compiled.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
