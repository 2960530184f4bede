"""Every kernel compiles for a real GPU (sm_90) on this CPU machine: the interpreter alone would miss
compiler-only errors. Runs retopk_core.kernels.compile_check --small in a subprocess without
TRITON_INTERPRET (this process's kernels are interpreted ones)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_every_kernel_compiles_for_sm90():
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"triton's bundled ptxas is missing ({ptxas}): cannot compile for CUDA here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "retopk_core.kernels.compile_check", "--small"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    from retopk_core.kernels.compile_check import kernel_specs

    compiled = [line for line in proc.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) == len(kernel_specs(small=True)), proc.stdout
