"""Where a benchmark's or a record's numbers came from: the checkout's commit and the CPU's model name."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def checkout_commit() -> str | None:
    """This checkout's HEAD, abbreviated, "-dirty" when a tracked file differs from it (None outside git)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--exclude=*"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform.processor() where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
