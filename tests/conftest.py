"""Root pytest setup shared by every test folder: Triton's CPU interpreter, the `gpu` marker's skip
and the embedded model.

The `gpu`, `slow` and `full` markers are declared in pyproject.toml; `full` tests run only under
RETOPK_TEST_FULL=1 (`make test-full`). Loading the embedded SmolLM2-135M is the suite's costliest step,
so it is loaded at most once per pytest process through the session fixture `embedded_model`;
tests must not modify the returned model (its weights, config or attention implementation).
"""

from __future__ import annotations

import os

import pytest


def pytest_configure(config):
    # Without CUDA, Triton kernels can only run in its interpreter, and TRITON_INTERPRET is read when a
    # kernel is defined: set it before any test module (bench, server, kernels) imports one.
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RETOPK_TEST_FULL") != "1":  # `make test-full` sets it; `make test` (CI) runs without them
        skip_full = pytest.mark.skip(reason="a long test: `make test-full` runs it (RETOPK_TEST_FULL=1)")
        for item in items:
            if item.get_closest_marker("full") is not None:
                item.add_marker(skip_full)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_model():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, float32 on the CPU, shared read-only."""
    from retopk_core.models import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def live_server_process():
    """ONE real server on the embedded model (a LiveServer), shared by every test folder (server, client):
    the model load is the suite's most expensive step. Its HTTP front is on too (``live_http_url``)."""
    from tests._live_server import launch_server

    server = launch_server("--http-port", "0")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def live_server(live_server_process):
    """Address "127.0.0.1:PORT" of the shared live server's gRPC front."""
    return live_server_process.address


@pytest.fixture(scope="session")
def live_http_url(live_server_process):
    """"http://127.0.0.1:PORT" of the shared live server's OpenAI HTTP front (printed once it listens)."""
    import re
    import time

    line = re.compile(r"HTTP \(OpenAI API\) on (https?://\S+?)/v1")
    deadline = time.monotonic() + 30
    while not (match := line.search(live_server_process.output())):
        assert time.monotonic() < deadline, live_server_process.output()
        time.sleep(0.05)
    return match.group(1)
