"""The huge-page switch must run before torch is imported and must respect an explicit setting."""

import os
import subprocess
import sys

CHECK = ("import os, sys; from retopk_core.hugepages import enable_transparent_hugepages as e; "
         "ok = e(); import torch; print(ok, os.environ['THP_MEM_ALLOC_ENABLE'])")


def run(env_value=None):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_enabled_before_torch_and_explicit_setting_wins():
    assert run() == ["True", "1"]
    assert run("0") == ["True", "0"]


def test_reports_too_late_once_torch_is_imported(monkeypatch):
    import torch  # noqa: F401

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)  # restored after the test

    from retopk_core.hugepages import enable_transparent_hugepages

    assert enable_transparent_hugepages() is False
