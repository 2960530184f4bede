"""Secure defaults of the deployment files (issue #16): no server without a key, no Grafana admin/admin,
containers stopped only after the server's drain grace.

Compose's ``${VAR:?message}`` makes ``docker compose up`` fail when VAR is unset or empty, where
``${VAR:-}`` would start the server with no key at all.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE_FILES = ("compose.yaml", "compose.replicas.yaml")
REQUIRED = re.compile(r"^\$\{(\w+):\?[^}]+\}$")  # ${VAR:?message}: set and non-empty, or compose refuses


def services(name: str) -> dict[str, dict]:
    return yaml.safe_load((DOCKER / name).read_text())["services"]


def servers(name: str) -> dict[str, dict]:
    return {k: v for k, v in services(name).items() if k.startswith("retopk")}


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_server_requires_an_api_key(name):
    for service, spec in servers(name).items():
        env = spec["environment"]
        match = REQUIRED.match(env.get("RETOPK_API_KEY", ""))
        assert match and match.group(1) == "RETOPK_API_KEY", f"{name}:{service}: the key must be required"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_grafana_has_no_default_admin_password(name):
    password = services(name)["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert REQUIRED.match(password), f"{name}: Grafana's admin password must be required, got {password!r}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_stop_grace_outlasts_the_drain_grace(name):
    for service, spec in servers(name).items():
        drain = float(spec["environment"]["RETOPK_DRAIN_GRACE_S"])
        assert float(spec["stop_grace_period"].removesuffix("s")) > drain, f"{name}:{service}"


def test_kubernetes_pods_read_keys_from_a_required_secret():
    deployment = yaml.safe_load((DOCKER / "k8s" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    keys_file = Path(env["RETOPK_API_KEYS_FILE"])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    [name] = [n for n, m in mounts.items() if Path(m["mountPath"]) == keys_file.parent]
    assert mounts[name]["readOnly"] is True
    secret = volumes[name]["secret"]
    assert secret["secretName"] == "retopk-api-keys" and secret["optional"] is False  # no secret: no pod
    assert "RETOPK_API_KEY" not in env  # no key in the manifest itself
