"""CacheBudget: the bytes the KV block pool and the method-state pools may hold together.

Every growth of a pool asks the budget first (``charge``) and gives bytes back when it shrinks or a
method's pools are dropped (``refund``). A request the budget cannot hold raises BudgetExceeded before
anything is allocated, so a caller can free room (the engine evicts idle sessions) and try again.

Default size (``default_cache_bytes``): DEFAULT_CACHE_FRACTION of the memory free on the device once
the model is loaded: on a CUDA device what ``torch.cuda.mem_get_info`` reports free, on a CPU
``available_ram()``: the kernel's MemAvailable (``/proc/meminfo``), capped by what the memory cgroup's limit
leaves. In a container /proc/meminfo is the host's, so a pod limited to 8 GiB on a 256 GiB node would otherwise
size its cache for the node and be OOM-killed once sessions fill it.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_CACHE_FRACTION = 0.5


class BudgetExceeded(MemoryError):
    """The cache budget cannot hold ``need`` more bytes for ``what``; nothing was allocated. A MemoryError:
    whoever handles running out of memory (engine/faults.py: memory pressure, not a broken runner) handles it.

    session_id  the session that asked (None when not known at that point)
    kv          whether KV blocks were asked for (only freed KV blocks can serve them)
    method      for method state: the MethodSpec whose pools it was (set by the runner); a freed slot of
                that method serves it, and so may KV blocks the pool gives back from its free tail
    """

    def __init__(self, what: str, need: int, free: int, limit: int, session_id: str | None = None) -> None:
        self.what, self.need, self.free, self.limit, self.session_id = what, need, free, limit, session_id
        self.kv = "KV" in what
        self.method = None
        super().__init__(f"{what} needs {need} more bytes of cache memory, {free} of the budget's {limit} are "
                         "free (kv_cache_bytes)")


class CacheBudget:
    """``limit`` bytes; ``reserved`` of them allocated by pools. Engine thread only."""

    def __init__(self, limit: int) -> None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise ValueError(f"kv_cache_bytes must be a positive integer, got {limit!r}")
        self.limit = limit
        self.reserved = 0

    @property
    def free(self) -> int:
        return self.limit - self.reserved

    def check(self, nbytes: int, what: str, session_id: str | None = None) -> None:
        """BudgetExceeded unless ``nbytes`` more fit."""
        if nbytes > self.free:
            raise BudgetExceeded(what, nbytes, self.free, self.limit, session_id)

    def charge(self, nbytes: int, what: str, session_id: str | None = None) -> None:
        """Count ``nbytes`` as reserved (call it once the allocation succeeded; ``check`` first)."""
        self.check(nbytes, what, session_id)
        self.reserved += nbytes

    def refund(self, nbytes: int) -> None:
        self.reserved = max(0, self.reserved - nbytes)


def default_cache_bytes(device, fraction: float = DEFAULT_CACHE_FRACTION) -> int:
    """``fraction`` of the memory free on ``device`` right now (see the module docstring)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_ram()
    return max(1, int(free * fraction))


# The container's own memory cgroup, as cgroup v2 and v1 mount it (cpu_threads.py reads cpu.max the same way).
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
NO_LIMIT = 1 << 60  # v1 writes "no limit" as 2^63 rounded down to a page


def cgroup_free_bytes(v2: Path = CGROUP_V2, v1: Path = CGROUP_V1) -> int | None:
    """limit - (usage - inactive file cache) of this process's memory cgroup, at least 0, as ``docker stats``
    counts usage (the inactive page cache is reclaimed before the cgroup's OOM killer runs):
    v2 memory.max, memory.current, memory.stat's inactive_file; v1 memory.limit_in_bytes,
    memory.usage_in_bytes, memory.stat's total_inactive_file. None without a limit or a readable cgroup."""
    for root, limit_file, usage_file, inactive_key in (
            (v2, "memory.max", "memory.current", "inactive_file"),
            (v1, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")):
        try:
            limit_text = (root / limit_file).read_text().strip()
            if limit_text == "max":
                return None
            limit, usage = int(limit_text), int((root / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit >= NO_LIMIT:
            return None
        inactive = 0
        try:
            for line in (root / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, limit - max(0, usage - inactive))
    return None


def available_ram(meminfo: Path = Path("/proc/meminfo"), v2: Path = CGROUP_V2, v1: Path = CGROUP_V1) -> int:
    """MemAvailable, capped by ``cgroup_free_bytes`` where the cgroup sets a limit."""
    free = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    if free is None:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    cgroup = cgroup_free_bytes(v2, v1)
    return free if cgroup is None else min(free, cgroup)
