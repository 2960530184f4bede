"""Hyperparameters of ReTopK (the paper's K, C, W, R, tau, T_r), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReTopKConfig:
    """ReTopK hyperparameters, defaults as in the paper (K=512, C=W=32, R=4, tau=0.85, T_r=128).

    top_k          K   tokens attended per head and step (the support size)
    cache_size     C   capacity of each head's FIFO of (unit-norm query, support) pairs
    window         W   recent positions always added to the candidate set
    recall         R   cached entries recalled per step (R <= C)
    tau                fall back to Exact Top-K when max cached-query cosine < tau
    refresh_every  T_r exact refresh when the decode-step offset t_dec > 0 and t_dec % T_r == 0;
                       0 disables scheduled refresh
    retrieval          "similarity" (the paper) or "recent" (the ablation that recalls the R newest
                       entries instead of the R most similar)
    """

    top_k: int = 512
    cache_size: int = 32
    window: int = 32
    recall: int = 4
    tau: float = 0.85
    refresh_every: int = 128
    retrieval: str = "similarity"

    def __post_init__(self) -> None:
        for name in ("top_k", "cache_size", "recall"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("window", "refresh_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.recall > self.cache_size:
            raise ValueError(f"recall must be <= cache_size ({self.cache_size}), got {self.recall}")
        if not 0.0 <= float(self.tau) <= 1.0:
            raise ValueError(f"tau must lie in [0, 1], got {self.tau!r}")
        if self.retrieval not in ("similarity", "recent"):
            raise ValueError(f"retrieval must be 'similarity' or 'recent', got {self.retrieval!r}")

    @property
    def max_candidates(self) -> int:
        """Upper bound R*K + W on the candidate set of a reuse step (equation 14)."""
        return self.recall * self.top_k + self.window
