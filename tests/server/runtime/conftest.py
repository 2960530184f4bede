"""Fixtures of the runtime tests (helpers live in runtime_helpers.py)."""

from __future__ import annotations

import pytest
from runtime_helpers import ARCHS


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param
