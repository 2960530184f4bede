"""key_select.h (the kernel's Top-K cuts on 64-bit keys) against the standard library's std::nth_element on
(score, position) pairs under the kernel's two comparisons: Better (the exact pass) and the scores alone (the reuse
path's cut, equal scores included): the same permutation, entry for entry, not just the same set (the order is the
order attend sums in, so the kernel's bits rest on it). Compiled with g++ as a plain program
(tests/core/key_select_check.cpp, no torch)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_keys_follow_std_nth_element(tmp_path):
    exe = tmp_path / "key_select_check"
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{ROOT / 'retopk_core' / 'cpu'}",
                    str(ROOT / "tests" / "core" / "key_select_check.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("cases, 0 differ"), run.stdout
    tied = int(run.stdout.split(" score cuts with tied scores")[0])
    assert tied > 1000, run.stdout  # the tie-exact partition is exercised
