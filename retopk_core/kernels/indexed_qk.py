"""ReTopK stage 2, indexed QK: exact scores of each reuse head's packed candidates (eq. 10).

    ê_j = q_{b,h} . k_{b, h // G, A[b, h, j]} * scale,   j < M_{b,h}

Keys are read straight from the PagedKV pool by candidate position (no gathered key tensor). One
program per (sequence, query head, block of BLOCK_M candidates); heads with M = 0 (exact paths) and
blocks past M exit at once. Scores are float32, written next to the candidates (B, H, N_PAD).
"""

from __future__ import annotations

import triton
import triton.language as tl

from retopk_core.kernels.paged import pool_rows


@triton.jit
def indexed_qk_kernel(q_ptr, stride_qb, stride_qh, k_ptr, table_ptr, stride_tb, cand_ptr, count_ptr, out_ptr,
                      scale, H, H_KV, P, G, N_PAD,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    start = tl.program_id(2) * BLOCK_M
    row = b * H + h
    n = tl.load(count_ptr + row)
    if start >= n:
        return
    j = start + tl.arange(0, BLOCK_M)
    m = j < n
    pos = tl.load(cand_ptr + row * N_PAD + j, mask=m, other=0)
    rows = pool_rows(table_ptr, stride_tb, b, h // G, pos, m, H_KV, P)
    d = tl.arange(0, BLOCK_D)
    k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=m[:, None] & (d < D)[None, :], other=0.0)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    e = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale
    tl.store(out_ptr + row * N_PAD + j, e, mask=m)
