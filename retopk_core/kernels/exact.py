"""Exact Top-K support discovery over the full history (Exact Top-K, and ReTopK's fallback/refresh).

    e_i = q . k_i * scale  for every i < L_b              (equation 4; _exact_qk_kernel)
    S   = TopK_i e_i                                        (equation 1)

Top-K over L scores in two phases without host synchronisation:
  1. _chunk_topk_kernel: each CHUNK of positions keeps its K_pad best as sorted int64 keys
     (``bitonic.pack_key``: score bits above position bits, so one sort carries both);
  2. _merge_topk_kernel: FAN lists of K_pad at a time are merged into one, level by level, until one
     list is left. The lists are sorted, so a merge runs only the network's merging stages
     (``bitonic_topk(SORTED_RUNS=True)``, lists read in alternating directions), not a full sort.
     The number of levels depends only on L_cap = max_blocks * P (host-known).
The final list (B, H, K_pad) is sorted best-first; EMPTY pads sequences shorter than K_pad.

Paths: with ``path`` given (ReTopK), every kernel early-exits for heads whose path is REUSE (0), so
heads taking different paths share one launch per stage. A QK program serves the G query heads of
one KV head (GQA: keys read once per group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from retopk_core.kernels.bitonic import EMPTY, bitonic_topk, next_pow2, pack_key, sorted_run_index
from retopk_core.kernels.paged import pool_rows
from retopk_core.kernels.workspace import Workspace
from retopk_core.kv import PagedKV


@triton.jit
def _exact_qk_kernel(q_ptr, k_ptr, table_ptr, len_ptr, path_ptr, sc_ptr, scale,
                     stride_qb, stride_qh, stride_tb, H_KV, P, L_CAP,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_PATH: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    start = tl.program_id(2) * BLOCK_N
    L = tl.load(len_ptr + b)
    if start >= L:
        return
    H = H_KV * G
    hs = tl.arange(0, BLOCK_G)
    heads = g * G + hs
    if HAS_PATH:
        need = (hs < G) & (tl.load(path_ptr + b * H + heads, mask=hs < G, other=0) != 0)
    else:
        need = hs < G
    if tl.sum(need.to(tl.int32), 0) == 0:  # every head of this group reuses: nothing to score
        return
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=need[:, None] & (d < D)[None, :], other=0.0)  # (BLOCK_G, BLOCK_D)
    pos = start + tl.arange(0, BLOCK_N)
    valid = pos < L
    rows = pool_rows(table_ptr, stride_tb, b, g, pos, valid, H_KV, P)
    k = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0)
    if DOT_F32:
        e = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        e = tl.dot(q, tl.trans(k))
    e = tl.where(valid[None, :], e * scale, float("-inf"))  # (BLOCK_G, BLOCK_N)
    tl.store(sc_ptr + (b * H + heads)[:, None] * L_CAP + pos[None, :], e,
             mask=need[:, None] & (pos < L_CAP)[None, :])


@triton.jit
def _chunk_topk_kernel(sc_ptr, len_ptr, path_ptr, out_ptr, H, L_CAP, N_CHUNK,
                       CHUNK: tl.constexpr, K_PAD: tl.constexpr, HAS_PATH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    L = tl.load(len_ptr + b)
    start = c * CHUNK
    skip = start >= L  # the merge masks lists past the sequence: nothing to write
    if HAS_PATH:
        skip = skip | (tl.load(path_ptr + b * H + h) == 0)
    if skip:  # one top-level early exit (nested early returns are not portable across triton versions)
        return
    pos = start + tl.arange(0, CHUNK)
    valid = pos < L
    e = tl.load(sc_ptr + (b * H + h) * L_CAP + pos, mask=valid, other=0.0)
    key = tl.where(valid, pack_key(e, pos), EMPTY)
    top = bitonic_topk(key, K_PAD, True)
    tl.store(out_ptr + ((b * H + h) * N_CHUNK + c) * K_PAD + tl.arange(0, K_PAD), top)


@triton.jit
def _merge_topk_kernel(in_ptr, len_ptr, path_ptr, out_ptr, H, N_IN, N_OUT, SPAN_IN,
                       FAN: tl.constexpr, K_PAD: tl.constexpr, HAS_PATH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    j = tl.program_id(2)
    L = tl.load(len_ptr + b)
    skip = j * FAN * SPAN_IN >= L
    if HAS_PATH:
        skip = skip | (tl.load(path_ptr + b * H + h) == 0)
    if skip:
        return
    n_valid = (L + SPAN_IN - 1) // SPAN_IN  # input lists that cover some position < L
    i = sorted_run_index(tl.arange(0, FAN * K_PAD), K_PAD)  # even lists back to front: alternating runs
    li = j * FAN + i // K_PAD
    key = tl.load(in_ptr + ((b * H + h) * N_IN + li) * K_PAD + i % K_PAD, mask=li < n_valid, other=EMPTY)
    top = bitonic_topk(key, K_PAD, True, True)  # merging stages only: the input lists are sorted
    tl.store(out_ptr + ((b * H + h) * N_OUT + j) * K_PAD + tl.arange(0, K_PAD), top)


def exact_topk_keys(q: torch.Tensor, kv: PagedKV, top_k: int, scale: float, ws: Workspace,
                    path: torch.Tensor | None = None, chunk: int | None = None, fan: int | None = None,
                    block_n: int = 64) -> torch.Tensor:
    """Sorted Top-K sort keys (B, H, K_pad) int64 of every head (path None) or of the heads whose
    path (B, H) int8 is not REUSE (the other rows are left unspecified). A workspace view."""
    B, H, D = q.shape
    H_kv, P = kv.num_kv_heads, kv.block_size
    G = H // H_kv
    L_cap = kv.block_table.shape[1] * P
    K_pad = next_pow2(top_k, 16)
    chunk = max(2 * K_pad, 2048) if chunk is None else chunk
    if chunk < K_pad or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= K_pad ({K_pad}), got {chunk}")
    if fan is None:
        fan = max(2, min(64, 2048 // K_pad))  # merge blocks of <= 2048 keys (registers, compile time)
    if fan < 2 or fan & (fan - 1):
        raise ValueError(f"fan must be a power of two >= 2, got {fan}")
    has_path = path is not None
    path_arg = path if has_path else kv.lengths  # unused when HAS_PATH is false
    scores = ws.get("exact_scores", (B, H, L_cap), torch.float32)
    # 16-bit tensor-core dot when q and the cache share a 16-bit dtype; fp32 (IEEE) otherwise, and always
    # on CPU tensors: triton's interpreter multiplies 16-bit dot operands as raw bits (triton 3.9).
    dot_f32 = not q.is_cuda or not (q.dtype == kv.k_pool.dtype and q.dtype in (torch.float16, torch.bfloat16))
    _exact_qk_kernel[(B, H_kv, triton.cdiv(L_cap, block_n))](
        q, kv.k_pool, kv.block_table, kv.lengths, path_arg, scores, float(scale),
        q.stride(0), q.stride(1), kv.block_table.stride(0), H_kv, P, L_cap,
        G=G, BLOCK_G=next_pow2(G, 16), D=D, BLOCK_D=next_pow2(D, 16), BLOCK_N=block_n,
        HAS_PATH=has_path, DOT_F32=dot_f32, num_warps=4)
    n = triton.cdiv(L_cap, chunk)
    lists = ws.get("exact_lists_a", (B, H, n, K_pad), torch.int64)
    _chunk_topk_kernel[(B, H, n)](scores, kv.lengths, path_arg, lists, H, L_cap, n,
                                  CHUNK=chunk, K_PAD=K_pad, HAS_PATH=has_path, num_warps=8)
    span, names = chunk, ("exact_lists_b", "exact_lists_a")
    while n > 1:
        n_out = triton.cdiv(n, fan)
        merged = ws.get(names[0], (B, H, n_out, K_pad), torch.int64)
        _merge_topk_kernel[(B, H, n_out)](lists, kv.lengths, path_arg, merged, H, n, n_out, span,
                                          FAN=fan, K_PAD=K_pad, HAS_PATH=has_path, num_warps=8)
        lists, n, span, names = merged, n_out, span * fan, names[::-1]
    return lists.view(B, H, K_pad)
