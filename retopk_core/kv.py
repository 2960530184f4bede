"""A read-only view of B sequences' keys and values stored in a block pool.

The pool layout is (N_blocks, H_kv, P, d): block n holds P consecutive positions of every KV head.
Sequence b's logical block j lives in physical block ``block_table[b, j]``, so position i of
sequence b, KV head g, is row ``(block_table[b, i // P] * H_kv + g) * P + i % P`` of the pool
viewed as (N_blocks * H_kv * P, d). A padded batch (B, H_kv, L_cap, d) is the special case
P = L_cap with one block per sequence (``PagedKV.contiguous``), and costs no copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Runs of consecutive block ids read in place, one matmul each; a sequence in more pieces is gathered
# into one copy instead (bounding the number of small matmuls per layer).
MAX_RUNS = 8


def id_runs(ids: list[int]) -> list[tuple[int, int]]:
    """The runs of consecutive ids in ``ids``, in order: [(start, stop), ...] covering ``ids``, where
    ids[start:stop] == range(ids[start], ids[start] + stop - start) and each run is as long as it can be. Blocks
    ids[start:stop] of a pool are then the slice pool[ids[start]:ids[start] + stop - start], a view."""
    spans, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            spans.append((start, j))
            start = j
    return spans


@dataclass
class PagedKV:
    k_pool: torch.Tensor  # (N_blocks, H_kv, P, d), contiguous
    v_pool: torch.Tensor  # (N_blocks, H_kv, P, d_v), contiguous
    block_table: torch.Tensor  # (B, max_blocks) int64 physical block ids (unused entries arbitrary)
    lengths: torch.Tensor  # (B,) int64 valid positions per sequence (the current token included)

    def __post_init__(self) -> None:
        if self.k_pool.dim() != 4 or self.v_pool.dim() != 4:
            raise ValueError("k_pool and v_pool must be (N_blocks, H_kv, P, d)")
        if self.k_pool.shape[:3] != self.v_pool.shape[:3]:
            raise ValueError(f"k_pool {tuple(self.k_pool.shape)} and v_pool {tuple(self.v_pool.shape)} disagree")
        if not (self.k_pool.is_contiguous() and self.v_pool.is_contiguous()):
            raise ValueError("k_pool and v_pool must be contiguous")
        if self.block_table.dim() != 2 or self.lengths.shape != (self.block_table.shape[0],):
            raise ValueError("block_table must be (B, max_blocks) and lengths (B,)")

    @classmethod
    def contiguous(cls, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor | None = None) -> PagedKV:
        """View a padded batch k, v: (B, H_kv, L_cap, d) as one block per sequence (no copy)."""
        B, _, L_cap, _ = k.shape
        if lengths is None:
            lengths = torch.full((B,), L_cap, dtype=torch.long, device=k.device)
        table = torch.arange(B, device=k.device, dtype=torch.long).unsqueeze(1)  # (B, 1)
        return cls(k.contiguous(), v.contiguous(), table, lengths.to(device=k.device, dtype=torch.long))

    @property
    def batch(self) -> int:
        return self.block_table.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_pool.shape[1]

    @property
    def block_size(self) -> int:
        return self.k_pool.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_pool.shape[3]

    def flat_rows(self, b: torch.Tensor, g: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Pool rows of (sequence b, KV head g, position pos); all broadcast together. pos >= 0."""
        P, H_kv = self.block_size, self.num_kv_heads
        block = self.block_table[b, pos // P]  # same shape as the broadcast
        return (block * H_kv + g) * P + pos % P

    def gather_k(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Keys at pool rows (any shape S) -> (*S, d), written into ``out`` (numel S*d) when given."""
        return _gather(self.k_pool, rows, out)

    def gather_v(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Values at pool rows (any shape S) -> (*S, d_v), written into ``out`` when given."""
        return _gather(self.v_pool, rows, out)

    def keys(self, b: int, g: int, length: int | None = None) -> torch.Tensor:
        """All keys of sequence b, KV head g: (L_b, d). A view when the sequence has one block."""
        return self._history(self.k_pool, b, g, length)

    def values(self, b: int, g: int, length: int | None = None) -> torch.Tensor:
        """All values of sequence b, KV head g: (L_b, d_v)."""
        return self._history(self.v_pool, b, g, length)

    def blocks(self, pool: torch.Tensor, b: int, length: int | None = None) -> torch.Tensor:
        """Sequence b's first n = ceil(L_b / P) blocks of ``pool`` (k_pool or v_pool), every KV head:
        (n, H_kv, P, d). A view when the block ids are consecutive, else a gathered copy; positions
        past L_b in the last block are garbage."""
        runs = self.block_runs(pool, b, length)
        return runs[0] if len(runs) == 1 else torch.cat(runs)

    def block_runs(self, pool: torch.Tensor, b: int, length: int | None = None,
                   max_runs: int = MAX_RUNS) -> list[torch.Tensor]:
        """Sequence b's first n blocks as views of ``pool``, one per run of consecutive block ids:
        [(n_1, H_kv, P, d), ...] with n_1 + n_2 + ... = n, in order. A session's blocks are one run
        unless it grew while its neighbours did; past ``max_runs`` runs, one gathered copy."""
        L = int(self.lengths[b]) if length is None else length
        n = max(1, -(-L // self.block_size))
        ids = self.block_table[b, :n].tolist()
        spans = id_runs(ids)
        if len(spans) > max_runs:
            return [pool[self.block_table[b, :n]]]  # (n, H_kv, P, d) copy
        return [pool[ids[start]:ids[start] + stop - start] for start, stop in spans]  # (stop - start, H_kv, P, d) views

    def _history(self, pool: torch.Tensor, b: int, g: int, length: int | None) -> torch.Tensor:
        L = int(self.lengths[b]) if length is None else length
        runs = [r[:, g] for r in self.block_runs(pool, b, L)]  # [(n_i, P, d)], this head only
        return (runs[0] if len(runs) == 1 else torch.cat(runs)).flatten(0, 1)[:L]  # a view for one block

    def padded_rows(self, seqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool rows of sequences ``seqs`` (n,) (None = all), padded to their longest history L_max:
        (n, H_kv, L_max), positions past a sequence's length pointing at its last key (so a gather
        reads only real keys); and the padding mask (n, 1, L_max), True past each length."""
        seqs = torch.arange(self.batch, device=self.lengths.device) if seqs is None else seqs
        n = seqs.numel()
        lengths = self.lengths[seqs].view(n, 1, 1)  # (n, 1, 1)
        pos = torch.arange(int(lengths.max()) if n else 0, device=seqs.device).view(1, 1, -1)  # (1, 1, L_max)
        g = torch.arange(self.num_kv_heads, device=seqs.device).view(1, -1, 1)  # (1, H_kv, 1)
        last = (lengths - 1).clamp(min=0)
        return self.flat_rows(seqs.view(n, 1, 1), g, torch.minimum(pos, last)), pos >= lengths

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded copies (B, H_kv, L_max, d) of keys and values; zeros past each length."""
        rows, past = self.padded_rows()  # (B, H_kv, L_max), (B, 1, L_max)
        valid = ~past.unsqueeze(-1)  # (B, 1, L_max, 1)
        return self.gather_k(rows) * valid, self.gather_v(rows) * valid


def _gather(pool: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    flat = pool.view(-1, pool.shape[-1])  # (N_blocks * H_kv * P, d)
    idx = rows.reshape(-1)
    if out is None:
        return flat.index_select(0, idx).view(*rows.shape, -1)
    return torch.index_select(flat, 0, idx, out=out.view(idx.numel(), -1)).view(*rows.shape, -1)
