"""bench/gpu_check.py runs end to end under the interpreter on tiny shapes and writes its results.

`make test` runs it on one length without its own pytest pass (the kernel tests run in the suite anyway);
`make test-full` adds the run with the tests and two lengths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def run_tiny(tmp_path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run([sys.executable, "bench/gpu_check.py", "--interpret", "--tiny", "--batch", "2", "--iters",
                           "1", "--warmup", "1", "--reuse-share", "0.5", "--out-dir", str(tmp_path), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def check_rows(tmp_path, lengths: list[int]) -> dict:
    """The .md and .json it wrote: one row per length, every method timed, the ReTopK variants' shares in range."""
    md = list(tmp_path.glob("gpu_check_*_interpret.md"))
    js = list(tmp_path.glob("gpu_check_*_interpret.json"))
    assert len(md) == 1 and len(js) == 1
    data = json.loads(js[0].read_text())
    assert data["meta"]["mode"] == "interpret"
    assert [(r["B"], r["L"]) for r in data["rows"]] == [(2, n) for n in lengths]
    for r in data["rows"]:
        assert r["full_ms"] > 0 and r["exact_ms"] > 0 and r["retopk_ms"] > 0
        assert 0.0 <= r["reuse_share"] <= 1.0
        for v in ("reuse", "mix", "group"):  # the ReTopK variants: reuse alone, per-head mix, group policy
            assert r[f"retopk_{v}_ms"] > 0 and 0.0 <= r[f"retopk_{v}_group_read_share"] <= 1.0
        assert r["retopk_reuse_reuse_share"] == 1.0 and r["retopk_reuse_group_read_share"] == 0.0
        assert r["retopk_mix_reuse_share"] < 1.0  # the drawn fresh queries (half of them here) fall back
    text = md[0].read_text()
    assert "| B | L |" in text and "INTERPRETER RUN" in text and "ReTopK group ms/tok" in text
    return data


def test_gpu_check_interpret_tiny_one_length(tmp_path):
    proc = run_tiny(tmp_path, "--skip-tests", "--lengths", "96")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert check_rows(tmp_path, [96])["tests"] is None


@pytest.mark.full
def test_gpu_check_interpret_tiny_end_to_end(tmp_path):
    proc = run_tiny(tmp_path, "--lengths", "96", "200")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert check_rows(tmp_path, [96, 200])["tests"]["returncode"] == 0


def test_gpu_check_budget_skips_the_remaining_points(tmp_path):
    """--budget-s 0: no point starts; each is written as skipped, and the command still succeeds."""
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--interpret", "--tiny", "--skip-tests", "--lengths",
                           "96", "--batch", "1", "2", "--budget-s", "0", "--out-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(next(tmp_path.glob("gpu_check_*_interpret.json")).read_text())
    assert [(r["B"], r["L"], "skipped" in r) for r in data["rows"]] == [(1, 96, True), (2, 96, True)]
    assert "skipped" in next(tmp_path.glob("gpu_check_*_interpret.md")).read_text()
