"""The baseline tests run many tiny tensor ops; on a busy 2-core machine the intra-op thread pool's
synchronisation costs milliseconds per op (a (30, 8).min(0) measured 10 ms with 2 threads under load,
70 us with 1). Each test here runs single-threaded and restores the previous setting afterwards."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
