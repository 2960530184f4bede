"""HTTP front fixtures: ONE real `retopk-server` (embedded model, an API key, ``--http-port 0``) for every
test in tests/server/http, reached with the official ``openai`` package, raw ``httpx`` and the gRPC SDK.

http_server   (session) the LiveServer; ``http_server.http_url`` is "http://127.0.0.1:PORT"; the last test
              of test_raw_http.py drains it (SIGTERM); ``http_server.metrics_url`` its Prometheus page
openai_client / async_openai   openai.OpenAI / openai.AsyncOpenAI on ``<http_url>/v1`` with the key
grpc_client   retopk_client.Client on the same server's gRPC port with the key
raw           httpx.Client on ``http_url`` (no key unless a test sends one)
"""

from __future__ import annotations

import re
import time

import pytest

from tests._live_server import free_port, launch_server

KEY = "test-http-key"
HTTP_LINE = re.compile(r"HTTP \(OpenAI API\) on (https?://\S+?)/v1")
TIMEOUT = 300.0  # generous: the shared 2-core CI machine can be slow; a hang still fails


@pytest.fixture(scope="session")
def http_server():
    # One stream at a time and one waiting: test_raw_http fills the queue to see 429 (the one key may hold
    # both: --key-share 1). The drain grace is long so that the last test's stream finishes on a slow machine.
    metrics_port = free_port()
    server = launch_server("--http-port", "0", "--max-running", "1", "--max-queue", "1", "--drain-grace-s", "300",
                           "--key-share", "1",
                           "--metrics-port", str(metrics_port), env={"RETOPK_API_KEY": KEY}, timeout=600)
    server.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while not (match := HTTP_LINE.search(server.output())):
            if time.monotonic() > deadline or server.process.poll() is not None:
                raise RuntimeError(f"no HTTP front line in the server's output:\n{server.output()}")
            time.sleep(0.05)
        server.http_url = match.group(1)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def openai_client(http_server):
    import openai

    with openai.OpenAI(base_url=http_server.http_url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0) as c:
        yield c


@pytest.fixture
def async_openai(http_server):
    import openai

    return openai.AsyncOpenAI(base_url=http_server.http_url + "/v1", api_key=KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="session")
def grpc_client(http_server):
    from retopk_client import Client

    with Client(http_server.address, api_key=KEY, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="session")
def raw(http_server):
    import httpx

    with httpx.Client(base_url=http_server.http_url, timeout=TIMEOUT) as c:
        yield c


@pytest.fixture(scope="session")
def model(grpc_client) -> str:
    return grpc_client.model_info().name
