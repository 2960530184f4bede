"""docker/compose.replicas.yaml: N retopk replicas behind nginx, read as YAML and checked against
the nginx files it mounts (the replicas named there are the compose services, and each has its own
name so consistent hashing gives it its own points on the ring), the Prometheus targets and the
server's ports. tests/deploy/test_nginx_affinity.py runs the same routing files for real.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from retopk_server.config import ServerConfig

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.replicas.yaml"
NGINX = DOCKER / "nginx"
DEFAULTS = {f.name: f.default for f in dataclasses.fields(ServerConfig)}


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def replicas() -> dict[str, dict]:
    return {name: s for name, s in compose()["services"].items() if name.startswith("retopk-")}


def upstream_servers() -> list[str]:
    lines = (NGINX / "upstream-servers.conf").read_text().splitlines()
    return [m.group(1) for line in lines if (m := re.match(r"\s*server\s+(\S+)", line))]


def test_at_least_two_replicas_each_a_distinct_upstream_of_nginx():
    assert len(replicas()) >= 2
    hosts = [s.rsplit(":", 1) for s in upstream_servers()]
    assert sorted(h for h, _ in hosts) == sorted(replicas())
    assert {int(p) for _, p in hosts} == {DEFAULTS["port"]}


def test_replicas_share_one_image_build_and_a_drain_shorter_than_the_stop_grace():
    for name, service in replicas().items():
        assert service["image"] == "retopk:cpu" and service["build"]["dockerfile"] == "docker/Dockerfile.cpu", name
        assert (DOCKER.parent / service["build"]["dockerfile"]).is_file()
        drain = float(service["environment"]["RETOPK_DRAIN_GRACE_S"])
        assert float(service["stop_grace_period"].removesuffix("s")) > drain, name
        assert "retopk.v1.ReTopKService" in " ".join(service["healthcheck"]["test"]), name
        assert "ports" not in service, f"{name}: clients reach replicas through the router only"


def test_router_mounts_the_nginx_files_and_waits_for_healthy_replicas():
    router = compose()["services"]["router"]
    assert router["image"].startswith("nginx:")
    mounts = {m.split(":")[0]: m.split(":")[1] for m in router["volumes"]}
    for name in ("nginx.conf", "routing.conf", "grpc-proxy.conf", "upstream-servers.conf"):
        assert (NGINX / name).is_file()
        assert mounts[f"./nginx/{name}"] == f"/etc/nginx/{name}"
    assert {n: d["condition"] for n, d in router["depends_on"].items()} == dict.fromkeys(replicas(), "service_healthy")
    listen = re.search(r"listen\s+(\d+)\s+http2;", (NGINX / "nginx.conf").read_text())
    assert listen and router["ports"] == [f"{listen.group(1)}:{listen.group(1)}"]


def test_routing_hashes_the_session_header_then_the_prefix_key_and_balances_the_rest():
    routing = (NGINX / "routing.conf").read_text()
    assert re.search(r"upstream retopk_affinity \{\s*hash \$retopk_affinity_key consistent;", routing)
    assert re.search(r"upstream retopk_balanced \{\s*least_conn;", routing)
    assert re.search(r'map \$http_x_session_id \$retopk_affinity_key \{\s*""\s+\$http_x_prefix_key;'
                     r'\s*default\s+\$http_x_session_id;', routing)
    assert re.search(r'map \$retopk_affinity_key \$retopk_upstream \{\s*""\s+retopk_balanced;'
                     r'\s*default\s+retopk_affinity;', routing)
    assert "grpc_pass grpc://$retopk_upstream;" in (NGINX / "grpc-proxy.conf").read_text()


def test_prometheus_scrapes_every_replica():
    config = yaml.safe_load((DOCKER / "prometheus.replicas.yml").read_text())
    mounted = compose()["services"]["prometheus"]["volumes"][0].split(":")[0]
    assert mounted == "./prometheus.replicas.yml"
    [job] = config["scrape_configs"]
    targets = job["static_configs"][0]["targets"]
    assert sorted(targets) == sorted(f"{name}:{DEFAULTS['metrics_port']}" for name in replicas())


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian package prometheus)")
def test_prometheus_replicas_config_is_valid_for_promtool():
    result = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus.replicas.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_replica_saves_sessions_on_the_one_named_volume():
    """Issue 33: each replica's RETOPK_SESSION_DIR is where the named volume retopk-sessions is mounted, the same
    volume for all, so a restarted (or another) replica loads what a drained one saved."""
    for name, service in replicas().items():
        targets = [v.split(":")[1] for v in service["volumes"] if v.split(":")[0] == "retopk-sessions"]
        assert targets == [service["environment"]["RETOPK_SESSION_DIR"]], name
    assert "retopk-sessions" in compose()["volumes"]
