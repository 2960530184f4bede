"""Synthetic decode traces for core tests: clustered queries (reuse), outliers (fallback), growing KV."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from retopk_core.kv import PagedKV


@dataclass
class Trace:
    keys: torch.Tensor  # (B, H_kv, L_cap, d)  prompt + one new key per decode step
    values: torch.Tensor  # (B, H_kv, L_cap, d)
    prompt_lens: list[int]
    prompt_queries: torch.Tensor  # (B, H, T, d) the last T prompt queries
    queries: torch.Tensor  # (steps, B, H, d)

    def lengths_at(self, step: int) -> torch.Tensor:
        """Cached length of each sequence at decode step `step` (the current token included)."""
        return torch.tensor([p + step + 1 for p in self.prompt_lens])


def make_trace(B=3, H=6, H_kv=2, d=16, prompt_lens=(40, 23, 9), steps=12, T=6, seed=0, outlier_p=0.2,
               noise=0.15) -> Trace:
    g = torch.Generator().manual_seed(seed)
    L_cap = max(prompt_lens) + steps
    keys = torch.randn(B, H_kv, L_cap, d, generator=g)
    values = torch.randn(B, H_kv, L_cap, d, generator=g)
    centers = torch.randn(B, H, 2, d, generator=g)  # two query clusters per head

    def draw(n):  # (n, B, H, d) clustered queries with occasional outliers
        pick = torch.randint(0, 2, (n, B, H), generator=g)
        base = centers.unsqueeze(0).expand(n, B, H, 2, d).gather(3, pick.view(n, B, H, 1, 1).expand(n, B, H, 1, d))
        q = base.squeeze(3) + noise * torch.randn(n, B, H, d, generator=g)
        outlier = torch.rand(n, B, H, generator=g) < outlier_p
        return torch.where(outlier.unsqueeze(-1), 2 * torch.randn(n, B, H, d, generator=g), q)

    return Trace(keys, values, list(prompt_lens), draw(T).permute(1, 2, 0, 3).contiguous(), draw(steps))


def paged(keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, block: int, seed: int = 0) -> PagedKV:
    """The same sequences in a shuffled block pool (N_blocks, H_kv, P, d), to exercise block tables."""
    B, H_kv, L_cap, d = keys.shape
    nb = -(-L_cap // block)
    pad = nb * block - L_cap
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad)).view(B, H_kv, nb, block, d).permute(0, 2, 1, 3, 4)
    v = torch.nn.functional.pad(values, (0, 0, 0, pad)).view(B, H_kv, nb, block, d).permute(0, 2, 1, 3, 4)
    perm = torch.randperm(B * nb, generator=torch.Generator().manual_seed(seed))  # logical -> physical
    k_pool = torch.empty(B * nb, H_kv, block, d)
    v_pool = torch.empty(B * nb, H_kv, block, d)
    k_pool[perm] = k.reshape(B * nb, H_kv, block, d)
    v_pool[perm] = v.reshape(B * nb, H_kv, block, d)
    return PagedKV(k_pool, v_pool, perm.view(B, nb), lengths.long())
