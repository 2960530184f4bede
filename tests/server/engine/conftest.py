"""Fixtures of the engine tests (helpers live in engine_helpers.py)."""

from __future__ import annotations

import pytest

from tests.server.engine.engine_helpers import make_engine


@pytest.fixture
def engine_runner():
    engine, runner = make_engine()
    yield engine, runner
    engine.stop()
