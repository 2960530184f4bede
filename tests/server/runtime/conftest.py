"""Fixtures of the runtime tests (helpers live in runtime_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Run these tests on one intra-op thread, restored afterwards: the tiny models' matrices are so small
    that waking a second thread costs more than it saves, and far more on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
