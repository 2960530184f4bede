"""Real `retopk-server` replicas (the embedded SmolLM2-135M) behind Debian's nginx running docker/nginx/routing.conf
and grpc-proxy.conf unchanged, from a temporary prefix (pid, logs and temp paths there; nothing needs root),
loopback only: what test_nginx_affinity.py and test_nginx_handoff.py stand on.

``nginx_cluster(replicas, *server_args)`` starts them (``{router}`` in an argument becomes the router's address, so a
replica can be told its own router, as ``--handoff-peer`` wants), checks the configuration with ``nginx -t``, and
yields a ``Cluster``; ``access_log`` reads which upstream served each request. Skips only where no nginx binary
exists; `make test-full` installs it (scripts/install_system_deps.sh).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from retopk_client import Client, NotFound
from tests._live_server import LiveServer, free_port, launch_servers

NGINX_DIR = Path(__file__).resolve().parents[2] / "docker" / "nginx"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None)
LOG_FORMAT = "'$http_x_session_id|$upstream_addr|$status|$request_uri'"


@dataclass
class Cluster:
    servers: list[LiveServer]
    router: str  # "127.0.0.1:PORT" of nginx
    prefix: Path  # nginx's prefix: access.log, error.log


def nginx_conf(prefix: Path, port: int, upstreams: list[str]) -> Path:
    """nginx.conf for a temporary prefix: the shipped routing files, loopback servers, an access log
    that names each request's session key and upstream."""
    for name in ("routing.conf", "grpc-proxy.conf"):
        shutil.copy(NGINX_DIR / name, prefix / name)
    (prefix / "upstream-servers.conf").write_text(
        "".join(f"server {u} max_fails=1 fail_timeout=30s;\n" for u in upstreams))
    temp = "\n".join(f"    {kind}_temp_path {prefix / kind};" for kind in ("client_body", "proxy", "fastcgi",
                                                                            "uwsgi", "scgi"))
    conf = prefix / "nginx.conf"
    conf.write_text(f"""daemon off;
worker_processes 1;
pid {prefix / "nginx.pid"};
error_log {prefix / "error.log"} notice;
events {{ worker_connections 1024; }}
http {{
    log_format retopk {LOG_FORMAT};
    access_log {prefix / "access.log"} retopk;
{temp}
    include routing.conf;
    server {{
        listen 127.0.0.1:{port} http2;
        location / {{
            include grpc-proxy.conf;
        }}
    }}
}}
""")
    return conf


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited with {process.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nginx is not listening on {port} after {timeout} s")


@contextlib.contextmanager
def nginx_cluster(replicas: int, *server_args: str) -> Iterator[Cluster]:
    """``replicas`` servers started with ``server_args`` (``{router}`` replaced) behind one nginx; all of it
    stopped on exit, nginx's error log printed (pytest shows it when the test failed)."""
    if NGINX is None:
        pytest.skip("needs nginx (Debian package nginx, which scripts/install_system_deps.sh installs)")
    port = free_port()
    router = f"127.0.0.1:{port}"
    servers = launch_servers(replicas, *(a.replace("{router}", router) for a in server_args), timeout=600)
    prefix = Path(tempfile.mkdtemp(prefix="retopk-nginx-"))
    prefix.chmod(0o755)  # nginx's workers may run as another user when the test runs as root
    conf = nginx_conf(prefix, port, [s.address for s in servers])
    nginx_args = [NGINX, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    nginx = None
    try:
        check = subprocess.run([*nginx_args[:1], "-t", *nginx_args[1:]], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
        nginx = subprocess.Popen(nginx_args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        wait_for_port(port, nginx)
        yield Cluster(servers, router, prefix)
    finally:
        if nginx is not None:
            nginx.terminate()
            nginx.wait(30)
        if (prefix / "error.log").exists():
            print("nginx error log:\n" + (prefix / "error.log").read_text()[-4000:])
        for server in servers:
            server.kill()
        shutil.rmtree(prefix, ignore_errors=True)


def access_log(prefix: Path) -> list[tuple[str, str, str, str]]:
    """(session key, upstream(s), HTTP status, rpc path) of every request nginx finished."""
    lines = (prefix / "access.log").read_text().splitlines()
    return [tuple(line.split("|")) for line in lines if line]


def logged_since(prefix: Path, mark: int, rpc: str, count: int, timeout: float = 10.0) -> list[tuple]:
    """The access log's ``rpc`` entries after line ``mark`` once there are ``count`` (nginx writes an
    entry just after the response ends, so the last may land a moment after the client returned)."""
    deadline = time.monotonic() + timeout
    while True:
        entries = [e for e in access_log(prefix)[mark:] if e[3].endswith("/" + rpc)]
        if len(entries) >= count or time.monotonic() > deadline:
            return entries
        time.sleep(0.05)


def holder(servers: list[LiveServer], session_id: str) -> list[int]:
    """Indices of the replicas that hold ``session_id`` (asked directly, not through nginx)."""
    out = []
    for index, server in enumerate(servers):
        if server.process.poll() is not None:
            continue
        with Client(server.address, timeout=30) as direct:
            try:
                direct.get_session(session_id)
                out.append(index)
            except NotFound:
                pass
    return out
