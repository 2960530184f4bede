"""TLS and mutual TLS from PEM files: the server (--tls-cert/--tls-key/--tls-client-ca), the SDK
(``tls``, ``ca``, ``cert``, ``key``) and the CLI (``--tls``, ``--ca``, ``--cert``, ``--key``).

Each test makes its own CA with ``trustme``: a client that trusts it completes the handshake; plain
text to a TLS port, a client that does not trust the server's CA, and (with mTLS) a client without a
certificate or with one from another CA are refused in the handshake (UNAVAILABLE, nothing served).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from retopk_client import Client, RetryPolicy
from retopk_client.cli import main as cli_main
from retopk_client.errors import Unavailable
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from retopk_server.cli import config_from
from retopk_server.config import ServerConfig
from retopk_server.service.server import serve
from tests.server.fake_runner import FakeRunner

trustme = pytest.importorskip("trustme")
pytestmark = pytest.mark.timeout(60)
ONCE = RetryPolicy(max_attempts=1)


class Pki:
    """A CA, a server certificate for 127.0.0.1 / localhost, a client certificate, and a second CA, as files."""

    def __init__(self, root) -> None:
        self.root = root
        ca, other = trustme.CA(), trustme.CA()
        self.ca = self._write("ca.pem", ca.cert_pem)
        self.other_ca = self._write("other-ca.pem", other.cert_pem)
        self.server_cert, self.server_key = self._pair("server", ca.issue_cert("127.0.0.1", "localhost"))
        self.client_cert, self.client_key = self._pair("client", ca.issue_cert("client@example.org"))
        self.stranger_cert, self.stranger_key = self._pair("stranger", other.issue_cert("client@example.org"))

    def _write(self, name: str, blob) -> str:
        path = self.root / name
        blob.write_to_path(str(path))
        return str(path)

    def _pair(self, name: str, issued) -> tuple[str, str]:
        chain = self.root / f"{name}-chain.pem"
        chain.write_bytes(b"".join(pem.bytes() for pem in issued.cert_chain_pems))
        return str(chain), self._write(f"{name}-key.pem", issued.private_key_pem)


@pytest.fixture
def pki(tmp_path) -> Pki:
    return Pki(tmp_path)


def tls_server(fake_server, pki: Pki, mutual: bool = False, **overrides):
    return fake_server(tls_cert=pki.server_cert, tls_key=pki.server_key,
                       tls_client_ca=pki.ca if mutual else None, **overrides)


def plain_call(address: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            pb_grpc.ReTopKServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    raise AssertionError("plain text was served")


def test_tls_handshake_succeeds_and_plain_text_is_refused(fake_server, pki):
    server = tls_server(fake_server, pki)
    with Client(server.address, ca=pki.ca, retry=ONCE, timeout=10) as client:
        assert client.config.tls  # ca implies tls
        assert client.model_info().name == "fake"
        assert "".join(c.text for c in client.generate("hi", max_new_tokens=3))
        assert client.health() == "SERVING"
    assert plain_call(server.address) == grpc.StatusCode.UNAVAILABLE
    with Client(server.address, ca=pki.other_ca, retry=ONCE, timeout=10) as client, pytest.raises(Unavailable):
        client.model_info()  # the server's certificate is not signed by the CA this client trusts
    creds = grpc.ssl_channel_credentials(root_certificates=open(pki.ca, "rb").read())
    with grpc.secure_channel(server.address, creds) as channel:  # health over TLS needs no key or client cert
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_mutual_tls_needs_a_client_certificate_from_the_ca(fake_server, pki):
    server = tls_server(fake_server, pki, mutual=True)
    with Client(server.address, ca=pki.ca, cert=pki.client_cert, key=pki.client_key, retry=ONCE,
                timeout=10) as client:
        assert client.model_info().name == "fake"
    for cert, key in ((None, None), (pki.stranger_cert, pki.stranger_key)):
        with Client(server.address, ca=pki.ca, cert=cert, key=key, retry=ONCE, timeout=10) as client:
            with pytest.raises(Unavailable):
                client.model_info()
    assert plain_call(server.address) == grpc.StatusCode.UNAVAILABLE


def test_tls_and_keys_together(fake_server, pki):
    server = tls_server(fake_server, pki, mutual=True, api_key="sekret")
    kwargs = dict(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, retry=ONCE, timeout=10)
    with Client(server.address, api_key="sekret", **kwargs) as client:
        assert client.model_info().name == "fake"
    with Client(server.address, **kwargs) as client, pytest.raises(Exception) as info:
        client.model_info()
    assert info.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_cli_tls_flags(fake_server, pki, capsys, monkeypatch):
    for name in ("RETOPK_TLS", "RETOPK_TLS_CA", "RETOPK_TLS_CLIENT_CERT", "RETOPK_TLS_CLIENT_KEY", "RETOPK_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    server = tls_server(fake_server, pki, mutual=True)
    base = ["--address", server.address, "--timeout", "10"]
    assert cli_main([*base, "--ca", pki.ca, "--cert", pki.client_cert, "--key", pki.client_key, "info"]) == 0
    assert "fake" in capsys.readouterr().out
    monkeypatch.setenv("RETOPK_TLS_CA", pki.ca)  # the environment works as the flags do
    monkeypatch.setenv("RETOPK_TLS_CLIENT_CERT", pki.client_cert)
    monkeypatch.setenv("RETOPK_TLS_CLIENT_KEY", pki.client_key)
    assert cli_main([*base, "health"]) == 0
    monkeypatch.delenv("RETOPK_TLS_CLIENT_CERT")
    monkeypatch.delenv("RETOPK_TLS_CLIENT_KEY")
    assert cli_main([*base, "health"]) == 3  # no client certificate: the handshake fails, unreachable
    capsys.readouterr()


@pytest.mark.parametrize("argv, words", [
    (["--tls-cert", "c.pem"], "tls_key"),
    (["--tls-key", "k.pem"], "tls_key"),
    (["--tls-client-ca", "ca.pem"], "tls_client_ca"),
])
def test_incomplete_tls_configuration_exits_with_a_message(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        config_from(argv, {})
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_flags_and_environment_reach_the_config():
    config = config_from(["--tls-cert", "c.pem", "--reflection", "false"],
                         {"RETOPK_TLS_KEY": "k.pem", "RETOPK_API_KEYS_FILE": "keys.txt",
                          "RETOPK_MAX_STREAMS_PER_KEY": "3"})
    assert (config.tls_cert, config.tls_key, config.tls, config.reflection) == ("c.pem", "k.pem", True, False)
    assert (config.api_keys_file, config.max_streams_per_key, config.max_sessions_per_key) == ("keys.txt", 3, None)
    assert config_from([], {}).reflection is True and not config_from([], {}).tls


@pytest.mark.parametrize("overrides", [
    {"tls_cert": "missing-cert.pem", "tls_key": "missing-key.pem"},
    {"api_keys_file": "missing-keys.txt"},
])
def test_serve_exits_1_on_unreadable_security_files_before_loading(overrides, caplog):
    built = []
    config = ServerConfig(host="127.0.0.1", port=0, metrics_port=0, **overrides)
    assert asyncio.run(serve(config, lambda: built.append(1) or FakeRunner())) == 1
    assert built == []  # refused before the model load
    assert "missing-" in caplog.text


def test_bench_load_generator_over_mutual_tls(fake_server, pki):
    from retopk_client.loadgen import BenchConfig, run_bench

    server = tls_server(fake_server, pki, mutual=True)
    config = dict(address=server.address, concurrency=2, requests=4, max_new_tokens=3, timeout=10, ca=pki.ca)
    report = run_bench(BenchConfig(**config, cert=pki.client_cert, key=pki.client_key))
    assert (report.requests_ok, report.requests_failed) == (4, 0)
    report = run_bench(BenchConfig(**config))  # no client certificate: every request refused in the handshake
    assert report.requests_ok == 0 and report.errors_by_code == {"UNAVAILABLE": 4}
