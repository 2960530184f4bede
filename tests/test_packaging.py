"""Packaging: the generated gRPC stubs are fresh and import as a package, both wheels hold what they
should, the client installs and imports without torch, and the pins that must agree do."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO / "proto"
STUB_DIR = REPO / "client" / "retopk_proto"


def _load_gen_proto():
    spec = importlib.util.spec_from_file_location("gen_proto_under_test", REPO / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen_proto = _load_gen_proto()


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


# ---- the stubs in the package -------------------------------------------------------------------


def test_package_stubs_equal_a_fresh_generation(tmp_path):
    assert gen_proto.find_protos(PROTO_DIR), "proto/ holds the wire contract"
    assert STUB_DIR.is_dir(), "stubs are generated at install (make install-test, or python scripts/gen_proto.py)"
    gen_proto.generate(PROTO_DIR, tmp_path)
    fresh, installed = _tree(tmp_path), _tree(STUB_DIR)
    assert sorted(installed) == sorted(fresh), "stale or missing stubs: run python scripts/gen_proto.py"
    for rel, data in fresh.items():
        assert installed[rel] == data, f"{rel} differs from what proto/ generates: run python scripts/gen_proto.py"


def test_every_proto_has_importable_stubs_in_retopk_proto():
    for proto in gen_proto.find_protos(PROTO_DIR):
        dotted = ".".join(proto.relative_to(PROTO_DIR).with_suffix("").parts)
        messages = importlib.import_module(f"retopk_proto.{dotted}_pb2")
        services = importlib.import_module(f"retopk_proto.{dotted}_pb2_grpc")
        assert messages.DESCRIPTOR.name == proto.relative_to(PROTO_DIR).as_posix()
        for service in messages.DESCRIPTOR.services_by_name:
            assert hasattr(services, f"{service}Stub")
            assert hasattr(services, f"{service}Servicer")
            assert hasattr(services, f"add_{service}Servicer_to_server")


# ---- the generator on throwaway protos ----------------------------------------------------------

_COMMON_PROTO = """
syntax = "proto3";
package pkgtest.common;
message Token { int32 id = 1; string text = 2; }
"""

_API_PROTO = """
syntax = "proto3";
package pkgtest.v1;
import "pkgtest/common/token.proto";
import "google/protobuf/duration.proto";
message Request { string prompt = 1; google.protobuf.Duration deadline = 2; }
message Chunk { repeated pkgtest.common.Token tokens = 1; }
service Echo { rpc Stream(Request) returns (stream Chunk); }
"""


def _write_throwaway_protos(root: Path) -> Path:
    proto_dir = root / "proto"
    (proto_dir / "pkgtest" / "common").mkdir(parents=True)
    (proto_dir / "pkgtest" / "v1").mkdir(parents=True)
    (proto_dir / "pkgtest" / "common" / "token.proto").write_text(_COMMON_PROTO)
    (proto_dir / "pkgtest" / "v1" / "api.proto").write_text(_API_PROTO)
    return proto_dir


def test_generated_imports_are_relative_and_work_inside_a_package(tmp_path):
    proto_dir = _write_throwaway_protos(tmp_path)
    out = tmp_path / "site" / "outer" / "_stubs"
    (tmp_path / "site" / "outer").mkdir(parents=True)
    (tmp_path / "site" / "outer" / "__init__.py").write_text("")
    gen_proto.generate(proto_dir, out)

    files = _tree(out)
    for rel in [
        "__init__.py",
        "pkgtest/__init__.py",
        "pkgtest/common/__init__.py",
        "pkgtest/common/token_pb2.py",
        "pkgtest/v1/api_pb2.py",
        "pkgtest/v1/api_pb2.pyi",
        "pkgtest/v1/api_pb2_grpc.py",
    ]:
        assert rel in files, rel
    for rel, data in files.items():
        assert not re.search(rb"^(from|import) pkgtest\b", data, re.M), f"absolute import left in {rel}"
    assert b"from ..common import token_pb2" in files["pkgtest/v1/api_pb2.py"]
    assert b"from . import api_pb2" in files["pkgtest/v1/api_pb2_grpc.py"]

    # In a fresh interpreter (its own descriptor pool), with only the outer package on sys.path.
    script = textwrap.dedent(
        """
        import sys
        sys.path.insert(0, sys.argv[1])
        from outer._stubs.pkgtest.v1 import api_pb2, api_pb2_grpc
        chunk = api_pb2.Chunk(tokens=[{"id": 7, "text": "Paris"}])
        again = api_pb2.Chunk.FromString(chunk.SerializeToString())
        assert again.tokens[0].text == "Paris", again
        assert api_pb2.Request(deadline={"seconds": 3}).deadline.seconds == 3
        assert callable(api_pb2_grpc.EchoStub) and callable(api_pb2_grpc.add_EchoServicer_to_server)
        assert "pkgtest" not in sys.modules, "stubs imported the top-level name pkgtest"
        """
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "site")], check=True, timeout=120)


def test_relativize_rewrites_only_generated_packages():
    source = (
        "from google.protobuf import duration_pb2 as d\n"
        "from a.b import x_pb2 as ab_x\n"
        "from a.c import y_pb2 as ac_y\n"
        "import a.b.z_pb2 as ab_z\n"
        "from a import top_pb2 as a_top\n"
    )
    got = gen_proto.relativize_imports(source, "a/b/w_pb2.py", {"a", "a.b", "a.c"})
    assert got == (
        "from google.protobuf import duration_pb2 as d\n"
        "from . import x_pb2 as ab_x\n"
        "from ..c import y_pb2 as ac_y\n"
        "from . import z_pb2 as ab_z\n"
        "from .. import top_pb2 as a_top\n"
    )


def test_regeneration_is_a_no_op_and_removes_stale_files(tmp_path):
    proto_dir = _write_throwaway_protos(tmp_path)
    out = tmp_path / "out"
    assert gen_proto.generate(proto_dir, out)
    stale = out / "pkgtest" / "v1" / "removed_pb2.py"
    stale.write_text("# from a deleted proto\n")
    assert gen_proto.generate(proto_dir, out) == ["pkgtest/v1/removed_pb2.py"]
    assert not stale.exists()
    assert gen_proto.generate(proto_dir, out) == []


def test_no_protos_is_an_error(tmp_path):
    with pytest.raises(gen_proto.ProtoGenerationError, match="no .proto files"):
        gen_proto.generate(tmp_path, tmp_path / "out")
    assert gen_proto.main(["--proto-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 1


# ---- pins and metadata ---------------------------------------------------------------------------


def test_grpcio_tools_pin_agrees_everywhere():
    root, client = _pyproject(REPO / "pyproject.toml"), _pyproject(REPO / "client" / "pyproject.toml")
    make_pin = re.search(r"^GRPC_TOOLS := (\S+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    pins = {
        "client build": [r for r in client["build-system"]["requires"] if r.startswith("grpcio-tools")],
        "test extra": [r for r in root["project"]["optional-dependencies"]["test"] if r.startswith("grpcio-tools")],
        "Makefile": [make_pin],
    }
    assert all(found == [make_pin] for found in pins.values()), pins
    assert make_pin == f"grpcio-tools=={importlib.metadata.version('grpcio-tools')}"


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_client_distribution_needs_only_grpcio_and_protobuf():
    client = _pyproject(REPO / "client" / "pyproject.toml")["project"]
    assert _requirement_names(client["dependencies"]) == {"grpcio", "protobuf"}
    assert not client.get("optional-dependencies")
    assert client["scripts"] == {"retopk": "retopk_client.cli:main"}


def test_console_scripts_resolve():
    scripts = _pyproject(REPO / "pyproject.toml")["project"]["scripts"]
    assert set(scripts) == {"retopk-server"}  # `retopk` is the client distribution's
    scripts |= _pyproject(REPO / "client" / "pyproject.toml")["project"]["scripts"]
    for target in scripts.values():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), target


@pytest.mark.parametrize("command", [["retopk_client.cli", "retopk"], ["retopk_server.cli", "retopk-server"]])
def test_console_scripts_answer_help(command):
    module, prog = command
    script = f"import sys; from {module} import main; sys.argv = [{prog!r}, '--help']; sys.exit(main())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage" in done.stdout.lower()


def test_client_imports_without_torch():
    """Every retopk_client and retopk_shared module imports with torch, transformers, triton, numpy and the server
    blocked."""
    script = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        BLOCKED = ("torch", "transformers", "triton", "numpy", "retopk_core", "retopk_server")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{name} must not be imported by the client")
        sys.meta_path.insert(0, Block())
        import retopk_client, retopk_proto, retopk_shared
        names = [m.name for m in pkgutil.walk_packages(retopk_client.__path__, "retopk_client.")]
        names += [m.name for m in pkgutil.walk_packages(retopk_shared.__path__, "retopk_shared.")]
        names += [m.name for m in pkgutil.walk_packages(retopk_proto.__path__, "retopk_proto.")]
        for name in names:
            if not name.endswith(".__main__"):  # running it is the command, not an import
                importlib.import_module(name)
        assert "retopk_client.cli" in names and "retopk_proto.retopk.v1.retopk_pb2" in names, names
        """
    )
    env_path = str(REPO / "client")
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {env_path!r})\n" + script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def _files_importing(module_pattern: str, folders: tuple[str, ...]) -> list[str]:
    """The .py files under ``folders`` with an import of a module matching ``module_pattern`` (a regex)."""
    line = re.compile(rf"^\s*(from|import) {module_pattern}", re.M)
    return [path.relative_to(REPO).as_posix() for folder in folders for path in (REPO / folder).rglob("*.py")
            if line.search(path.read_text())]


def test_nothing_imports_a_private_module_of_the_client():
    """The wire package is public (retopk_proto); no code outside the client reaches into retopk_client._*."""
    offenders = _files_importing(r"retopk_client\._", ("server", "retopk_core", "bench"))
    assert not offenders, offenders


def test_server_and_shared_never_import_the_client():
    """The server, the core and the package both sides share import no retopk_client: what the server needs of
    the client's conventions lives in retopk_shared, so the server runs without the client distribution."""
    offenders = _files_importing(r"retopk_client\b", ("server", "retopk_core", "client/retopk_shared"))
    assert not offenders, offenders


# ---- the wheels -----------------------------------------------------------------------------------

_IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "retopk_proto", "*.pyc")


def _build_wheel(source: Path, out: Path) -> zipfile.ZipFile:
    """pip wheel without build isolation (uses this venv's setuptools and pinned grpcio-tools)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _metadata(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in wheel.namelist() if n.endswith(".dist-info/" + name)]
    return wheel.read(path).decode()


def _copy_sources(dest: Path, parts: list[str]) -> None:
    for part in parts:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=_IGNORE)
        elif src.is_file():
            (dest / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / part)


@pytest.mark.slow
def test_client_wheel_generates_stubs_and_holds_only_the_client(tmp_path):
    src = tmp_path / "src"
    _copy_sources(src, ["client", "proto", "scripts/gen_proto.py"])
    assert not (src / "client" / "retopk_proto").exists()
    wheel = _build_wheel(src / "client", tmp_path / "wheel")
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"retopk_client", "retopk_shared",
                                                                           "retopk_proto"}
    for proto in gen_proto.find_protos(PROTO_DIR):
        stem = "retopk_proto/" + proto.relative_to(PROTO_DIR).with_suffix("").as_posix()
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            assert stem + suffix in names
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)", _metadata(wheel, "METADATA"), re.M)
    assert {r.lower() for r in requires} == {"grpcio", "protobuf"}
    assert "retopk = retopk_client.cli:main" in _metadata(wheel, "entry_points.txt")


@pytest.mark.slow
def test_root_wheel_holds_core_and_server_and_installs_beside_the_client(tmp_path):
    """The server's wheel holds retopk_core and retopk_server and depends on retopk-client, whose wheel holds the
    rest: no file is in both, both install into one folder, and the server imports from there."""
    src = tmp_path / "src"
    parts = ["pyproject.toml", "README.md", "MANIFEST.in", "retopk_core", "server", "client", "proto"]
    _copy_sources(src, [*parts, "scripts"])
    wheel = _build_wheel(src, tmp_path / "wheel")
    names = wheel.namelist()
    top_level = {n.split("/")[0] for n in names if ".dist-info/" not in n}
    assert top_level == {"retopk_core", "retopk_server"}
    for folder, package in [(".", "retopk_core"), ("server", "retopk_server")]:
        for path in (REPO / folder / package).rglob("*.py"):
            rel = path.relative_to(REPO / folder).as_posix()
            if "__pycache__" not in rel:
                assert rel in names, rel
    from retopk_core.cpu import build  # the fused CPU library compiles from the installed package's files
    for path in (*build.SOURCES, *build.HEADERS):
        assert path.relative_to(REPO).as_posix() in names, path
    entry_points = _metadata(wheel, "entry_points.txt")
    assert "retopk-server = retopk_server.cli:main" in entry_points and "retopk =" not in entry_points
    requires = _requirement_names(re.findall(r"^Requires-Dist: (.+)$", _metadata(wheel, "METADATA"), re.M))
    assert {"retopk-client", "torch", "transformers", "gguf", "accelerate", "grpcio", "protobuf"} <= requires

    client = _build_wheel(src / "client", tmp_path / "client_wheel")
    files = [n for n in names if ".dist-info/" not in n]
    assert not set(files) & set(client.namelist())
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(target), wheel.filename, client.filename], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stderr.strip(), done.stdout + done.stderr  # no overwritten file
    script = ("import retopk_client, retopk_core, retopk_proto, retopk_server.service.gateway as g, retopk_shared\n"
              "print('\\n'.join(m.__file__ for m in (retopk_client, retopk_core, retopk_proto, g, retopk_shared)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(target)})
    assert done.returncode == 0, done.stderr
    assert all(line.startswith(str(target)) for line in done.stdout.split()), done.stdout
