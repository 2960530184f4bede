"""Client test fixtures.

live_server  (session) address "127.0.0.1:PORT" of ONE real `retopk-server` with the embedded model,
             shared by every client test (tests/_live_server.py launches it; loading costs ~18 s).
client       (session) a sync ``Client`` on it.
run_cli      run ``python -m retopk_client.cli ARGS`` as a subprocess against the live server.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from retopk_client import Client
from tests._live_server import REPO

# Generous per-call deadline: the shared 2-core CI machine can be slow; a hang still fails.
CALL_TIMEOUT = 300.0


@pytest.fixture(scope="session")
def client(live_server):
    with Client(live_server, timeout=CALL_TIMEOUT) as c:
        yield c


def cli_env(address: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: this tree's client on PYTHONPATH, no RETOPK_* but ours."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RETOPK_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "client"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if address is not None:
        env["RETOPK_ADDRESS"] = address
    env.update(extra)
    return env


@pytest.fixture
def run_cli(live_server):
    def run(*args: str, input: str | None = None, timeout: float = CALL_TIMEOUT) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "retopk_client.cli", *args], input=input, capture_output=True, text=True,
            timeout=timeout, env=cli_env(live_server),
        )

    return run
