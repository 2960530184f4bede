"""Hyperparameters of ReTopK (the paper's K, C, W, R, tau, T_r), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

GQA_POLICIES = ("head", "promote", "group")


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
    gqa_policy         how the G = H / H_kv query heads sharing a KV group decide (GQA). A head on an
                       exact path reads every key of its group, so what a step costs is how many
                       groups are read, not how many heads fall back:
                       "head"     the paper: each head decides alone (eq. 13)
                       "promote"  as "head"; then, in a group read for any of its heads, every head
                                  takes the exact support too (path PROMOTED): better supports and
                                  more exact FIFO entries for the same key reads
                       "group"    one decision per group: read it when the mean of its heads' ρ_max
                                  is below tau or their lowest is below group_tau_min; a read group's
                                  heads all take the exact support (FALLBACK below tau, else
                                  PROMOTED), an unread group's heads all reuse
    group_tau_min      "group" policy: the lowest ρ_max of a group that still lets it reuse (0 = only
                       the mean decides)
    dense_below        L_min: a sequence shorter than this (the current token included) attends to every
                       position (path DENSE) and pushes the exact Top-K of those scores into its FIFO,
                       so the first sparse step at L_min finds exact supports; 0 = never (the paper)
    """

    top_k: int = 512
    cache_size: int = 32
    window: int = 32
    recall: int = 4
    tau: float = 0.85
    refresh_every: int = 128
    retrieval: str = "similarity"
    gqa_policy: str = "head"
    group_tau_min: float = 0.0
    dense_below: int = 0

    def __post_init__(self) -> None:
        for name in ("top_k", "cache_size", "recall"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("window", "refresh_every", "dense_below"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.recall > self.cache_size:
            raise ValueError(f"recall must be <= cache_size ({self.cache_size}), got {self.recall}")
        for name in ("tau", "group_tau_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {value!r}")
        if self.retrieval not in ("similarity", "recent"):
            raise ValueError(f"retrieval must be 'similarity' or 'recent', got {self.retrieval!r}")
        if self.gqa_policy not in GQA_POLICIES:
            raise ValueError(f"gqa_policy must be one of {', '.join(GQA_POLICIES)}, got {self.gqa_policy!r}")

    @property
    def max_candidates(self) -> int:
        """Upper bound R*K + W on the candidate set of a reuse step (equation 14)."""
        return self.recall * self.top_k + self.window
