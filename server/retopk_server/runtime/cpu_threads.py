"""How many threads the model's CPU work runs on.

torch sizes its intra-op pool by the cores it sees, which in a container is the host's: a pod limited to 2 CPUs
on a 64-core node would start 64 threads that take turns on 2 CPUs' worth of time, and every parallel region
of a decode step (several hundred) would wait for the slowest. The server's default is therefore the CPUs this
process may actually use: its affinity mask, capped by the cgroup v2 CPU quota (``cpu.max``, what Docker's
``--cpus`` and a Kubernetes CPU limit set), rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
MAX_THREADS = 1024  # a bound on the option, far above any machine this runs on


def cgroup_cpu_limit(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """ceil(quota / period) from a cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD"); None without a quota
    (no file, no limit, or a file this cannot read)."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return max(1, math.ceil(q / p)) if q > 0 and p > 0 else None


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on (its affinity mask), capped by the cgroup's CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cpu_max)
    return min(cpus, limit) if limit else cpus


def default_threads() -> int | None:
    """The server's default thread count: None (torch's own choice) when OMP_NUM_THREADS says it, else
    ``available_cpus()``."""
    return None if os.environ.get("OMP_NUM_THREADS") else available_cpus()


def apply_threads(threads: int | None) -> int:
    """Size torch's intra-op pool: ``threads``, or ``default_threads()`` when None; returns the count in force."""
    import torch  # here: importing this module must not load torch (the CLI enables huge pages first)

    n = threads if threads is not None else default_threads()
    if n is not None:
        torch.set_num_threads(n)
    return torch.get_num_threads()
