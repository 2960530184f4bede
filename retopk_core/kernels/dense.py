"""Full attention decode: split-K over the sequence, then a log-sum-exp merge (flash-decoding).

For query head h (KV head g = h // G) of sequence b with L_b keys, split s covers positions
[s*SPLIT, min((s+1)*SPLIT, L_b)) and produces
    m_s = max_i e_i,  l_s = sum_i exp(e_i - m_s),  o_s = sum_i exp(e_i - m_s) v_i / l_s,
    lse_s = m_s + log l_s                                        (e_i = q . k_i * scale)
and the merge returns  o = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M),  M = max_s lse_s,
which equals softmax(e) V over all L_b positions. A split program serves all G query heads of one
KV head (GQA: each key is read once per group), as a (G x d) @ (d x BLOCK_N) product.

With a length limit L_lim > 0 (ReTopK's dense floor, rows with L_b < L_lim), sequences with
L_b >= L_lim are skipped (their output rows are left unwritten) and the splits cover only
[0, min(L_cap, L_lim)): a step where no row is below the floor costs B * H_kv programs that exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from retopk_core.kernels.bitonic import next_pow2
from retopk_core.kernels.paged import pool_rows
from retopk_core.kernels.workspace_cache import Workspace
from retopk_core.kv import PagedKV


@triton.jit
def dense_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, po_ptr, pl_ptr, scale,
                       stride_qb, stride_qh, stride_tb, H_KV, P, SPLIT, N_SPLIT, L_LIM,
                       G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    L = tl.load(len_ptr + b)
    if (L_LIM > 0) & (L >= L_LIM):  # above the dense floor: this row is not attended densely
        return
    hs = tl.arange(0, BLOCK_G)
    hmask = hs < G
    heads = g * G + hs
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=hmask[:, None] & (d < D)[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    if DOT_F32:
        q = q.to(tl.float32)
    lo = s * SPLIT
    hi = tl.minimum(lo + SPLIT, L)
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    den = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = pool_rows(table_ptr, stride_tb, b, g, pos, valid, H_KV, P)  # (BLOCK_N,)
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
        v = tl.load(v_ptr + rows[:, None] * DV + dv[None, :], mask=valid[:, None] & (dv < DV)[None, :], other=0.0)
        if DOT_F32:
            e = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            e = tl.dot(q, tl.trans(k))
        e = tl.where(valid[None, :], e * scale, float("-inf"))  # (BLOCK_G, BLOCK_N)
        m_new = tl.maximum(m, tl.max(e, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(e - m_new[:, None])
        den = den * alpha + tl.sum(p, 1)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    nonempty = den > 0
    o = acc / tl.where(nonempty, den, 1.0)[:, None]
    lse = tl.where(nonempty, m + tl.log(tl.where(nonempty, den, 1.0)), float("-inf"))
    H = H_KV * G
    part = (b * H + heads) * N_SPLIT + s  # (BLOCK_G,)
    tl.store(pl_ptr + part, lse, mask=hmask)
    tl.store(po_ptr + part[:, None] * DV + dv[None, :], o, mask=hmask[:, None] & (dv < DV)[None, :])


@triton.jit
def lse_merge_kernel(po_ptr, pl_ptr, out_ptr, len_ptr, stride_ob, stride_oh, H, N_SPLIT, L_LIM,
                     DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if (L_LIM > 0) & (tl.load(len_ptr + b) >= L_LIM):
        return
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    base = (b * H + h) * N_SPLIT
    m_vec = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    for s0 in range(0, N_SPLIT, BLOCK_S):  # pass 1: M = max_s lse_s (split 0 is never empty)
        m_vec = tl.maximum(m_vec, tl.load(pl_ptr + base + s0 + s, mask=(s0 + s) < N_SPLIT, other=float("-inf")))
    M = tl.max(m_vec, 0)
    den_vec = tl.zeros((BLOCK_S,), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for s0 in range(0, N_SPLIT, BLOCK_S):  # pass 2: weights exp(lse_s - M), 0 for empty splits
        sm = (s0 + s) < N_SPLIT
        lse = tl.load(pl_ptr + base + s0 + s, mask=sm, other=float("-inf"))
        o = tl.load(po_ptr + (base + s0 + s)[:, None] * DV + dv[None, :], mask=sm[:, None] & (dv < DV)[None, :],
                    other=0.0)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - M))
        den_vec += w
        acc += tl.sum(w[:, None] * o, 0)
    den = tl.sum(den_vec, 0)
    out = acc / den
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)


def dense_attention(q: torch.Tensor, kv: PagedKV, scale: float, ws: Workspace, target_programs: int | None = None,
                    block_n: int = 64, below: int = 0) -> torch.Tensor:
    """softmax(q K^T * scale) V over each sequence's whole history. q (B, H, d) -> (B, H, d_v) in q.dtype.

    Splits: about ``target_programs`` (B * H_kv * n_split) programs over the length capacity
    L_cap = max_blocks * P (known without reading the lengths back from the device), or over
    min(L_cap, below) when ``below`` > 0: then only rows with L_b < below are computed, the others'
    output rows are unspecified (the caller selects the rows it wants on the device).
    """
    B, H, D = q.shape
    H_kv, P, DV = kv.num_kv_heads, kv.block_size, kv.v_pool.shape[-1]
    G = H // H_kv
    L_cap = kv.block_table.shape[1] * P
    if below > 0:
        L_cap = min(L_cap, below)  # a row computed here has L_b < below
    if target_programs is None:
        target_programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count \
            if q.is_cuda else 4
    n_split = max(1, min(triton.cdiv(L_cap, block_n), triton.cdiv(target_programs, B * H_kv)))
    split = triton.cdiv(triton.cdiv(L_cap, n_split), block_n) * block_n
    n_split = triton.cdiv(L_cap, split)
    part_out = ws.get("dense_out", (B, H, n_split, DV), torch.float32)
    part_lse = ws.get("dense_lse", (B, H, n_split), torch.float32)
    out = torch.empty(B, H, DV, dtype=q.dtype, device=q.device)
    # 16-bit tensor-core dot when q and the cache share a 16-bit dtype; fp32 (IEEE) otherwise, and always
    # on CPU tensors: triton's interpreter multiplies 16-bit dot operands as raw bits (triton 3.9).
    half = q.dtype == kv.k_pool.dtype == kv.v_pool.dtype and q.dtype in (torch.float16, torch.bfloat16)
    dot_f32 = not q.is_cuda or not half
    dense_split_kernel[(B, H_kv, n_split)](
        q, kv.k_pool, kv.v_pool, kv.block_table, kv.lengths, part_out, part_lse, float(scale),
        q.stride(0), q.stride(1), kv.block_table.stride(0), H_kv, P, split, n_split, below,
        G=G, BLOCK_G=next_pow2(G, 16), D=D, BLOCK_D=next_pow2(D, 16), DV=DV, BLOCK_DV=next_pow2(DV, 16),
        BLOCK_N=block_n, DOT_F32=dot_f32, num_warps=4)
    lse_merge_kernel[(B, H)](part_out, part_lse, out, kv.lengths, out.stride(0), out.stride(1), H, n_split, below,
                              DV=DV, BLOCK_DV=next_pow2(DV, 16), BLOCK_S=min(next_pow2(n_split), 64))
    return out
