"""The HTTP front's transport, in process around a FakeRunner (no model, fast): TLS and mutual TLS with the
gRPC front's certificate files (each test makes its own CA with trustme), and a taken port failing the start.

A client that trusts the CA gets answers over HTTPS; plain HTTP to the port, a client that trusts another
CA, and (with mTLS) a client without a certificate from the CA are refused in the handshake.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl

import httpx
import pytest

from retopk_server.config import ServerConfig
from retopk_server.engine import Engine
from retopk_server.service.server import start
from tests.server.conftest import FakeServer
from tests.server.fake_runner import FakeRunner

trustme = pytest.importorskip("trustme")
from tests.server.test_tls import Pki  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.timeout(60)
BODY = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 3})


@pytest.fixture
def pki(tmp_path) -> Pki:
    return Pki(tmp_path)


@pytest.fixture
def servers():
    made: list[FakeServer] = []
    yield lambda **overrides: made.append(FakeServer(FakeRunner(), http_port=0, **overrides)) or made[-1]
    for server in made:
        server.close()


def context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def test_https_with_the_grpc_certificate(servers, pki):
    server = servers(tls_cert=pki.server_cert, tls_key=pki.server_key, api_key="sekret")
    url = server.running.http.url
    assert url.startswith("https://")
    with httpx.Client(base_url=url, verify=context(pki.ca), timeout=10) as client:
        assert client.get("/health").json() == {"status": "ok"}
        reply = client.post("/v1/completions", content=BODY, headers={"Authorization": "Bearer sekret"})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    with pytest.raises(httpx.HTTPError):  # plain text to the TLS port
        httpx.get(url.replace("https://", "http://") + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError):  # the server's certificate is not from the CA this client trusts
        httpx.get(url + "/health", verify=context(pki.other_ca), timeout=10)


def test_mutual_tls_needs_a_client_certificate_from_the_ca(servers, pki):
    server = servers(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    url = server.running.http.url + "/health"
    assert httpx.get(url, verify=context(pki.ca, pki.client_cert, pki.client_key), timeout=10).status_code == 200
    for cert, key in ((None, None), (pki.stranger_cert, pki.stranger_key)):
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=context(pki.ca, cert, key), timeout=10)


def test_plain_http_front_without_tls(servers):
    server = servers()
    assert server.running.http.url.startswith("http://")
    reply = httpx.post(server.running.http.url + "/v1/completions", content=BODY, timeout=10)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def test_a_taken_http_port_fails_the_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, http_port=taken.getsockname()[1])
        engine = Engine(FakeRunner, config.engine_config())
        engine.start()
        try:
            with pytest.raises(RuntimeError, match="HTTP port"):
                asyncio.run(start(config, engine))
        finally:
            engine.stop()
