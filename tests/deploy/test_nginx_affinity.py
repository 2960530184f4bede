"""Acceptance of the multi-replica deployment: three real `retopk-server` processes (the embedded
SmolLM2-135M) behind Debian's nginx running docker/nginx/routing.conf and grpc-proxy.conf unchanged,
from a temporary prefix (pid, logs and temp paths there; nothing needs root), loopback only.

- 20 sessions x 3 chat turns through nginx with the SDK: every request of a session reaches one
  replica (nginx's access log names the upstream of each request; the session lives on that replica
  only), and each later turn prefills only its new tokens (usage), never the conversation again.
- Requests without a session carry no x-session-id and spread over every replica; those naming a shared
  prompt start with x-prefix-key all reach one replica, whose prefix cache serves that start.
- One replica killed (SIGKILL) after turn 2: its sessions answer NOT_FOUND through nginx (the next
  replica on the hash ring does not hold them), the SDK's replay (Session(replay=True)) continues each
  of them in a new session on a live replica with the whole conversation, and every other session's
  third turn runs in place, prefilling only its new tokens.

Skips only where no nginx binary exists; `make test` installs it (scripts/install_system_deps.sh).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from retopk_client import Client, NotFound, RetryPolicy
from retopk_client.client import Session
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_proto.retopk.v1 import retopk_pb2_grpc as pb_grpc
from tests._live_server import free_port, launch_servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NGINX_DIR = Path(__file__).resolve().parents[2] / "docker" / "nginx"
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None)
REPLICAS, SESSIONS, TURNS, SESSIONLESS = 3, 20, 3, 12
NEW_TOKENS = 3
LOG_FORMAT = "'$http_x_session_id|$upstream_addr|$status|$request_uri'"


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


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 30.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"nginx exited with {process.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nginx is not listening on {port} after {timeout} s")


@pytest.fixture(scope="module")
def cluster():
    if NGINX is None:
        pytest.skip("needs nginx (Debian package nginx; `make test` installs it via scripts/install_system_deps.sh)")
    servers = launch_servers(REPLICAS, "--max-running", "8", timeout=600)
    prefix = Path(tempfile.mkdtemp(prefix="retopk-nginx-"))
    prefix.chmod(0o755)  # nginx's workers may run as another user when the test runs as root
    port = free_port()
    conf = nginx_conf(prefix, port, [s.address for s in servers])
    check = subprocess.run([NGINX, "-t", "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode == 0, check.stderr
    nginx = subprocess.Popen([NGINX, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, nginx)
        yield servers, f"127.0.0.1:{port}", prefix
    finally:
        nginx.terminate()
        nginx.wait(30)
        print("nginx error log:\n" + (prefix / "error.log").read_text()[-4000:])  # shown when the test failed
        for server in servers:
            server.kill()
        shutil.rmtree(prefix, ignore_errors=True)


def turn(session: Session, k: int, i: int):
    message = {"role": "user", "content": f"Session {i}, turn {k}: name a colour."}
    return session.complete(messages=[message], max_new_tokens=NEW_TOKENS, ignore_eos=True)


def holder(servers, session_id: str) -> list[int]:
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


def test_requests_naming_a_prefix_key_reach_the_replica_that_caches_it(cluster):
    """x-prefix-key (routing.conf): every request naming the key lands on one replica, whose prefix cache then
    serves the shared 600-token start to all but the first; the same requests without the key spread over the
    replicas (least_conn) and each replica's first one prefills the start again."""
    _, router, _ = cluster
    rng = random.Random(30)

    def cached(document: list[int], i: int, key: str | None) -> int:
        ids = document + [rng.randrange(100, 40000) for _ in range(100)]
        metadata = (("x-prefix-key", key),) if key else ()
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), max_new_tokens=1)
        return list(stub.Generate(request, metadata=metadata, timeout=300))[-1].usage.cached_prompt_tokens

    with grpc.insecure_channel(router) as channel:
        stub = pb_grpc.ReTopKServiceStub(channel)
        keyed, spread = ([rng.randrange(100, 40000) for _ in range(600)] for _ in range(2))
        # two blocks of 256 = one prefill chunk; the default method prefills its last 128 tokens in any case
        assert [cached(keyed, i, "doc-1") for i in range(5)] == [0, 512, 512, 512, 512]
        assert [cached(spread, i, None) for i in range(5)].count(0) >= 2


def test_sessions_stick_to_one_replica_spread_sessionless_and_survive_a_killed_replica(cluster):
    servers, router, prefix = cluster
    by_address = {s.address: i for i, s in enumerate(servers)}
    client = Client(router, timeout=120, retry=RetryPolicy(max_attempts=3, initial_backoff=0.05))
    pool = ThreadPoolExecutor(8)
    try:
        sessions = [client.session(method="full", replay=True) for _ in range(SESSIONS)]
        first_ids = [s.id for s in sessions]
        usages = defaultdict(list)

        # turns 1 and 2 of every session, concurrently
        for k in (1, 2):
            for i, done in enumerate(pool.map(lambda a, k=k: turn(sessions[a], k, a), range(SESSIONS))):
                usages[i].append(done.usage)
        homes = {}
        for i, s in enumerate(sessions):
            [homes[i]] = holder(servers, s.id)  # on exactly one replica
        assert len(set(homes.values())) >= 2, f"20 sessions all hashed onto one replica: {homes}"

        # sessionless requests: no x-session-id, least-connected over every replica
        mark = len(access_log(prefix))
        outs = list(pool.map(lambda j: client.complete(f"Count to {j}:", max_new_tokens=2, ignore_eos=True),
                             range(SESSIONLESS)))
        assert all(o.usage.generated_tokens == 2 and not o.session_id for o in outs)
        sessionless = logged_since(prefix, mark, "Generate", SESSIONLESS)
        assert len(sessionless) == SESSIONLESS and all(e[0] in ("", "-") for e in sessionless)  # nginx logs "-"
        assert {by_address[e[1]] for e in sessionless} == set(range(REPLICAS))

        # one replica dies between turns 2 and 3
        victim = max(set(homes.values()), key=lambda r: sum(h == r for h in homes.values()))
        lost = [i for i, h in homes.items() if h == victim]
        kept = [i for i in range(SESSIONS) if i not in lost]
        servers[victim].process.kill()
        servers[victim].process.wait(30)
        for i in lost:  # a clear status through the router: the replica that answers does not hold it
            with pytest.raises(NotFound, match="session"):
                client.get_session(sessions[i].id)
        for i, done in enumerate(pool.map(lambda a: turn(sessions[a], 3, a), range(SESSIONS))):
            usages[i].append(done.usage)
    finally:
        pool.shutdown()

    # every session's requests before the kill went to the one replica that holds it
    upstreams = defaultdict(set)
    for key, upstream, status, _ in access_log(prefix):
        if key in first_ids and status == "200":
            upstreams[key].add(upstream.split(", ")[-1])
    for i, sid in enumerate(first_ids):
        if i in kept:
            assert upstreams[sid] == {servers[homes[i]].address}, (i, upstreams[sid])
        else:
            assert servers[homes[i]].address in upstreams[sid]

    for i in kept:  # untouched: same session, same replica, three turns, only new tokens prefilled
        s = sessions[i]
        assert s.replays == 0 and s.id == first_ids[i]
        assert holder(servers, s.id) == [homes[i]]
        assert client.get_session(s.id).turns == TURNS
        for before, now in zip(usages[i], usages[i][1:], strict=False):
            assert now.prompt_tokens == now.session_tokens - now.generated_tokens - before.session_tokens
            assert now.prompt_tokens < before.session_tokens  # the history was not fed again
    for i in lost:  # replayed once into a new session on a live replica, with the whole conversation
        s = sessions[i]
        assert s.replays == 1 and s.id != first_ids[i]
        [new_home] = holder(servers, s.id)
        assert new_home != victim
        third = usages[i][2]
        assert third.generated_tokens == NEW_TOKENS
        assert third.prompt_tokens == third.session_tokens - NEW_TOKENS > usages[i][1].session_tokens
        assert client.get_session(s.id).turns == 1
    assert lost and kept
    client.close()
