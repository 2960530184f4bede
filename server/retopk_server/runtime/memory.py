"""MemoryUsage: the cache bytes a runner holds, as the metrics report them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryUsage:
    """kv_*: key/value blocks; method_state_*: the methods' per-session state (ReTopK's FIFOs).

    *_used: held by open sessions; *_reserved: allocated by the runner's pools (used or free).
    """

    kv_used: int = 0
    kv_reserved: int = 0
    method_state_used: int = 0
    method_state_reserved: int = 0
