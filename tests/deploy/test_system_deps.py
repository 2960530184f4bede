"""scripts/install_system_deps.sh: packages it cannot install fail `make test` (exit 1) unless the user opts out
with RETOPK_SKIP_SYSTEM_DEPS=1; it used to exit 0, and the nginx, Prometheus and KJV tests then skipped while
the suite passed. Run with stand-in dpkg-query / id / apt-get on PATH, so nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_system_deps.sh"


def _bin(tmp_path: Path, uid: int, apt: bool) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"dpkg-query": "exit 1", "id": f"echo {uid}"}  # nothing installed; this uid
    if apt:
        stubs["apt-get"] = f"echo apt-get \"$@\" >> {tmp_path / 'apt.log'}"
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    for tool in ("bash", "grep", "sh", "chmod", "rm", "printf"):  # what the script may call, and nothing else
        for d in ("/usr/bin", "/bin"):
            if os.path.exists(f"{d}/{tool}") and not (bin_dir / tool).exists():
                (bin_dir / tool).symlink_to(f"{d}/{tool}")
    return bin_dir


@pytest.mark.parametrize("uid, apt, why", [(1000, True, "not root"), (0, False, "no apt-get here")])
def test_missing_packages_it_cannot_install_fail_unless_opted_out(tmp_path, uid, apt, why):
    env = {"PATH": str(_bin(tmp_path, uid, apt))}
    failed = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    packages = "prometheus bible-kjv nginx debian-reference-en jargon-text libpython3-stdlib"
    assert failed.returncode == 1 and why in failed.stderr and packages in failed.stderr
    assert "RETOPK_SKIP_SYSTEM_DEPS=1" in failed.stderr
    opted_out = subprocess.run(["bash", str(SCRIPT)], env={**env, "RETOPK_SKIP_SYSTEM_DEPS": "1"},
                               capture_output=True, text=True)
    assert opted_out.returncode == 0 and "skip" in opted_out.stderr
    assert not (tmp_path / "apt.log").exists()  # nothing was installed either way


def test_make_test_runs_the_system_deps_step_before_pytest():
    """`make test` depends on system-deps, so the script's exit status stops it before pytest runs."""
    dry = subprocess.run(["make", "-n", "test", "PY=true", "VENV=/nonexistent"], cwd=REPO, capture_output=True,
                         text=True)
    lines = dry.stdout.splitlines()
    deps = next(i for i, line in enumerate(lines) if "install_system_deps.sh" in line)
    tests = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert deps < tests
