"""Summary statistics for the load generator: percentiles and latency summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) by linear interpolation between closest ranks.

    With the values sorted as x_0 <= ... <= x_{n-1}, position p = q/100 * (n-1) gives
    x_floor(p) + (p - floor(p)) * (x_ceil(p) - x_floor(p)). NaN for an empty sequence.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"q must lie in [0, 100], got {q!r}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])


@dataclass(frozen=True)
class LatencySummary:
    """Count, mean and p50/p90/p99 of a set of latencies, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> LatencySummary:
        ms = [s * 1000.0 for s in seconds]
        if not ms:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=len(ms),
            mean_ms=sum(ms) / len(ms),
            p50_ms=percentile(ms, 50),
            p90_ms=percentile(ms, 90),
            p99_ms=percentile(ms, 99),
            max_ms=max(ms),
        )

    def to_dict(self) -> dict:
        # NaN is not JSON: an empty summary reports null
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}
