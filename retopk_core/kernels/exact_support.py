"""Exact Top-K support discovery over the full history (Exact Top-K, and ReTopK's fallback/refresh).

    e_i = q . k_i * scale  for every i < L_b              (equation 4; exact_qk_kernel)
    S   = TopK_i e_i                                        (equation 1)

Top-K over L scores in two phases without host synchronisation:
  1. chunk_topk_kernel: each CHUNK of positions keeps its K_pad best as sorted int64 keys
     (``bitonic.pack_key``: score bits above position bits, so one sort carries both);
  2. merge_topk_kernel: FAN lists of K_pad at a time are merged into one, level by level, until one
     list is left. The lists are sorted, so a merge runs only the network's merging stages
     (``bitonic_topk(SORTED_RUNS=True)``, lists read in alternating directions), not a full sort.
     The number of levels depends only on L_cap = max_blocks * P (host-known).
The final list (B, H, K_pad) is sorted best-first; EMPTY pads sequences shorter than K_pad.

Work sized on the device: with ``path`` given (ReTopK), only heads whose path is not REUSE (0) need
this pass, and the step cannot know how many without a device-to-host copy. So one program
(exact_work_kernel) packs the rows b*H + h of those heads, and the KV groups b*H_kv + g holding one,
into work lists with their counts; the three kernels then run persistent grids of a fixed size (a few
programs per SM, host-known) that loop over count x blocks read from device memory. A step where
every head reuses costs one small wave per kernel instead of B*H_kv*L_cap/BLOCK_N QK programs and
B*H*(L_cap/CHUNK) chunk programs that each exit at once; a step with one exact head spreads its
work over the whole grid. A QK work item serves the G query heads of one KV group (GQA: keys read
once per group) and scores only the heads that need it. Without ``path`` (Exact Top-K) every head
is listed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from retopk_core.kernels.bitonic import EMPTY, bitonic_topk, next_pow2, pack_key, sorted_run_index
from retopk_core.kernels.paged import pool_rows
from retopk_core.kernels.workspace_cache import Workspace
from retopk_core.kv import PagedKV


@triton.jit
def exact_work_kernel(path_ptr, heads_ptr, groups_ptr, n_ptr, NH, G,
                      HAS_PATH: tl.constexpr, BLOCK: tl.constexpr):
    """One program. heads[:n[0]] = the rows b*H + h (ascending) whose path != REUSE (all NH rows without
    path); groups[:n[1]] = the KV groups (b*H + h) // G holding such a head."""
    i = tl.arange(0, BLOCK)
    n = 0
    for s in range(0, NH, BLOCK):
        idx = s + i
        need = idx < NH
        if HAS_PATH:
            need = need & (tl.load(path_ptr + idx, mask=idx < NH, other=0) != 0)
        tl.store(heads_ptr + n + tl.cumsum(need.to(tl.int32), 0) - 1, idx, mask=need)
        n += tl.sum(need.to(tl.int32), 0)
    tl.store(n_ptr, n)
    m = 0
    for s in range(0, NH // G, BLOCK):
        idx = s + i
        need = idx < NH // G
        if HAS_PATH:
            any_head = tl.zeros((BLOCK,), tl.int32)
            for j in range(0, G):
                any_head += (tl.load(path_ptr + idx * G + j, mask=need, other=0) != 0).to(tl.int32)
            need = need & (any_head > 0)
        tl.store(groups_ptr + m + tl.cumsum(need.to(tl.int32), 0) - 1, idx, mask=need)
        m += tl.sum(need.to(tl.int32), 0)
    tl.store(n_ptr + 1, m)


@triton.jit
def exact_qk_kernel(q_ptr, k_ptr, table_ptr, len_ptr, path_ptr, groups_ptr, n_ptr, sc_ptr, scale,
                    stride_qb, stride_qh, stride_tb, H_KV, P, L_CAP, N_BLK,
                    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_PATH: tl.constexpr, DOT_F32: tl.constexpr):
    H = H_KV * G
    hs = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    for w in range(tl.program_id(0), tl.load(n_ptr + 1) * N_BLK, tl.num_programs(0)):  # (group, block) items
        bg = tl.load(groups_ptr + w // N_BLK).to(tl.int64)
        b = bg // H_KV
        g = bg % H_KV
        start = (w % N_BLK) * BLOCK_N
        L = tl.load(len_ptr + b)
        if start < L:
            heads = g * G + hs
            if HAS_PATH:  # score only the group's heads that take an exact path
                need = (hs < G) & (tl.load(path_ptr + b * H + heads, mask=hs < G, other=0) != 0)
            else:
                need = hs < G
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
def chunk_topk_kernel(sc_ptr, len_ptr, heads_ptr, n_ptr, out_ptr, H, L_CAP, N_CHUNK,
                      CHUNK: tl.constexpr, K_PAD: tl.constexpr):
    for w in range(tl.program_id(0), tl.load(n_ptr) * N_CHUNK, tl.num_programs(0)):  # (head, chunk) items
        row = tl.load(heads_ptr + w // N_CHUNK).to(tl.int64)  # b * H + h
        c = w % N_CHUNK
        start = c * CHUNK
        L = tl.load(len_ptr + row // H)
        if start < L:  # chunks past the sequence: the merge masks their lists, nothing to write
            pos = start + tl.arange(0, CHUNK)
            valid = pos < L
            e = tl.load(sc_ptr + row * L_CAP + pos, mask=valid, other=0.0)
            key = tl.where(valid, pack_key(e, pos), EMPTY)
            top = bitonic_topk(key, K_PAD, True)
            tl.store(out_ptr + (row * N_CHUNK + c) * K_PAD + tl.arange(0, K_PAD), top)


@triton.jit
def merge_topk_kernel(in_ptr, len_ptr, heads_ptr, n_ptr, out_ptr, H, N_IN, N_OUT, SPAN_IN,
                      FAN: tl.constexpr, K_PAD: tl.constexpr):
    i = sorted_run_index(tl.arange(0, FAN * K_PAD), K_PAD)  # even lists back to front: alternating runs
    for w in range(tl.program_id(0), tl.load(n_ptr) * N_OUT, tl.num_programs(0)):  # (head, output list) items
        row = tl.load(heads_ptr + w // N_OUT).to(tl.int64)
        j = w % N_OUT
        L = tl.load(len_ptr + row // H)
        if j * FAN * SPAN_IN < L:
            n_valid = (L + SPAN_IN - 1) // SPAN_IN  # input lists that cover some position < L
            li = j * FAN + i // K_PAD
            key = tl.load(in_ptr + (row * N_IN + li) * K_PAD + i % K_PAD, mask=li < n_valid, other=EMPTY)
            top = bitonic_topk(key, K_PAD, True, True)  # merging stages only: the input lists are sorted
            tl.store(out_ptr + (row * N_OUT + j) * K_PAD + tl.arange(0, K_PAD), top)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def persistent_programs(device: torch.device, per_sm: int, work: int, cpu: int = 3) -> int:
    """Grid size of a persistent kernel: ``per_sm`` programs per SM (``cpu`` under the interpreter),
    never more than the largest possible number of work items."""
    n = per_sm * _sm_count(device) if device.type == "cuda" else cpu
    return max(1, min(n, work))


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
    heads = ws.get("exact_heads", (B * H,), torch.int32)
    groups = ws.get("exact_groups", (B * H_kv,), torch.int32)
    n_work = ws.get("exact_n_work", (2,), torch.int32)
    exact_work_kernel[(1,)](path_arg, heads, groups, n_work, B * H, G, HAS_PATH=has_path, BLOCK=1024)
    scores = ws.get("exact_scores", (B, H, L_cap), torch.float32)
    # 16-bit tensor-core dot when q and the cache share a 16-bit dtype; fp32 (IEEE) otherwise, and always
    # on CPU tensors: triton's interpreter multiplies 16-bit dot operands as raw bits (triton 3.9).
    dot_f32 = not q.is_cuda or not (q.dtype == kv.k_pool.dtype and q.dtype in (torch.float16, torch.bfloat16))
    n_blk = triton.cdiv(L_cap, block_n)
    exact_qk_kernel[(persistent_programs(q.device, 16, B * H_kv * n_blk),)](
        q, kv.k_pool, kv.block_table, kv.lengths, path_arg, groups, n_work, scores, float(scale),
        q.stride(0), q.stride(1), kv.block_table.stride(0), H_kv, P, L_cap, n_blk,
        G=G, BLOCK_G=next_pow2(G, 16), D=D, BLOCK_D=next_pow2(D, 16), BLOCK_N=block_n,
        HAS_PATH=has_path, DOT_F32=dot_f32, num_warps=4)
    n = triton.cdiv(L_cap, chunk)
    lists = ws.get("exact_lists_a", (B, H, n, K_pad), torch.int64)
    chunk_topk_kernel[(persistent_programs(q.device, 4, B * H * n),)](
        scores, kv.lengths, heads, n_work, lists, H, L_cap, n, CHUNK=chunk, K_PAD=K_pad, num_warps=8)
    span, names = chunk, ("exact_lists_b", "exact_lists_a")
    while n > 1:
        n_out = triton.cdiv(n, fan)
        merged = ws.get(names[0], (B, H, n_out, K_pad), torch.int64)
        merge_topk_kernel[(persistent_programs(q.device, 4, B * H * n_out),)](
            lists, kv.lengths, heads, n_work, merged, H, n, n_out, span, FAN=fan, K_PAD=K_pad, num_warps=8)
        lists, n, span, names = merged, n_out, span * fan, names[::-1]
    return lists.view(B, H, K_pad)
