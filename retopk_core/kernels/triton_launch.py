"""The three entry points the torch methods call with ``backend="triton"``.

    dense_decode(q, kv, scale)                       -> out (B, H, d_v)          FullAttention
    exact_topk_decode(q, kv, top_k, scale)           -> (out, sel_pos (B, H, K)) ExactTopK
    retopk_decode(method, q, kv, state, slots, scale) -> StepOutput               ReTopK

Same semantics as the torch path. ReTopK runs a fixed sequence of launches whatever the paths of
its heads (no host synchronisation): selector -> indexed QK (reuse heads) -> exact QK / chunk Top-K /
merge (non-reuse heads) -> select + attend + FIFO write (each head reads its path's scores; the same
launch advances the FIFO pointer, fill and step counters). The dense floor
(``dense_below``) is decided on the device too: rows below it take path DENSE, get the exact Top-K
for their FIFO entry from the exact kernels, and their output from the dense kernel (whose launch
covers positions < dense_below only); as in the torch path, rows with L + C < dense_below are plain
dense steps (no exact Top-K, no FIFO entry, ``selected`` -1, only the step counter advances). Each
head's threshold is state.tau[slot, h]; with ``tau_calibration`` the selector builds every head's
candidates A_t and the select + attend launch moves the thresholds of the exact (non-DENSE) heads by
the recall reuse would have had (``calibrate_tau``); with ``refresh_guard`` the selector decides each head's
refresh on its own period state.period[slot, h] and select + attend moves the periods of the refresh heads
that would have reused by the same recall (``guard_period``); with ``tau_guard`` select + attend raises the
thresholds of the exact heads that would have reused and whose recall missed the target (``guard_tau``).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton

from retopk_core.kernels.bitonic import next_pow2
from retopk_core.kernels.dense import dense_attention
from retopk_core.kernels.exact_support import exact_topk_keys
from retopk_core.kernels.indexed_qk import indexed_qk_kernel
from retopk_core.kernels.select_attend import select_attend_kernel
from retopk_core.kernels.selector import selector_kernel
from retopk_core.kernels.workspace_cache import WORKSPACES, Workspace
from retopk_core.kv import PagedKV
from retopk_core.methods.retopk_policy import (
    below_floor,
    calibration_constants,
    gqa_paths,
    guard_constants,
    plain_dense,
)
from retopk_core.methods.step_output import Path, StepOutput

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _on_q_device(q_at: int):
    """Launch on q's GPU (triton launches on the current CUDA device, which may be another one).

    q_at  the position of ``q`` among the launcher's arguments (also found when passed by name)
    """
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            q = kwargs["q"] if "q" in kwargs else args[q_at]
            with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
                return fn(*args, **kwargs)
        return wrapper
    return decorate


def check_inputs(q: torch.Tensor, kv: PagedKV) -> None:
    """Shapes, strides, dtypes and devices every kernel relies on; ValueError naming the culprit."""
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, d), got shape {tuple(q.shape)}")
    B, H, D = q.shape
    if q.stride(-1) != 1:
        raise ValueError("q must have a unit stride along d")
    if q.dtype not in _DTYPES or kv.k_pool.dtype not in _DTYPES or kv.v_pool.dtype not in _DTYPES:
        raise ValueError(f"q / k_pool / v_pool dtypes must be fp16, bf16 or fp32, got "
                         f"{q.dtype} / {kv.k_pool.dtype} / {kv.v_pool.dtype}")
    if kv.head_dim != D:
        raise ValueError(f"q head dim {D} != k_pool head dim {kv.head_dim}")
    if kv.batch != B:
        raise ValueError(f"q batch {B} != kv batch {kv.batch}")
    if H % kv.num_kv_heads:
        raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({kv.num_kv_heads})")
    if kv.block_table.dtype != torch.long or kv.lengths.dtype != torch.long:
        raise ValueError("kv.block_table and kv.lengths must be int64")
    if kv.block_table.stride(-1) != 1:
        raise ValueError("kv.block_table must have a unit stride along blocks")
    for name, t in (("k_pool", kv.k_pool), ("v_pool", kv.v_pool), ("block_table", kv.block_table),
                    ("lengths", kv.lengths)):
        if t.device != q.device:
            raise ValueError(f"kv.{name} is on {t.device}, q on {q.device}")


@_on_q_device(q_at=0)
def dense_decode(q: torch.Tensor, kv: PagedKV, scale: float, ws: Workspace | None = None) -> torch.Tensor:
    """Full attention of the current queries q (B, H, d) -> (B, H, d_v) in q.dtype."""
    check_inputs(q, kv)
    return dense_attention(q, kv, scale, ws or WORKSPACES.shared(q.device))


@_on_q_device(q_at=0)
def exact_topk_decode(q: torch.Tensor, kv: PagedKV, top_k: int, scale: float, ws: Workspace | None = None,
                      chunk: int | None = None, fan: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact Top-K attention: (out (B, H, d_v) in q.dtype, sel_pos (B, H, top_k) int64 -1 padded)."""
    check_inputs(q, kv)
    ws = ws or WORKSPACES.shared(q.device)
    B, H, D = q.shape
    keys = exact_topk_keys(q, kv, top_k, scale, ws, chunk=chunk, fan=fan)  # (B, H, K_pad)
    out, sel = _attend(q, kv, top_k, ws, keys, retopk=None)
    return out, sel


@_on_q_device(q_at=1)  # retopk_decode(method, q, ...)
def retopk_decode(method, q: torch.Tensor, kv: PagedKV, state, slots: torch.Tensor, scale: float,
                  ws: Workspace | None = None, chunk: int | None = None) -> StepOutput:
    """One ReTopK decode step for every head (eq. 6-13), updating ``state`` like the torch path."""
    check_inputs(q, kv)
    cfg = method.config
    B, H, D = q.shape
    S, H_state, C, D_state = state.queries.shape
    K, W, R = cfg.top_k, cfg.window, cfg.recall
    if (H_state, D_state) != (H, D) or state.support.shape != (S, H, C, K):
        raise ValueError(f"state is for H={H_state}, d={D_state}, K={state.support.shape[-1]}; "
                         f"q has H={H}, d={D}, top_k={K}")
    if state.queries.dtype != torch.float32 or state.support.dtype != torch.long:
        raise ValueError("state.queries must be float32 and state.support int64")
    if slots.shape != (B,) or slots.dtype != torch.long or slots.device != q.device:
        raise ValueError(f"slots must be (B,) int64 on {q.device}")
    if state.queries.device != q.device:
        raise ValueError(f"state is on {state.queries.device}, q on {q.device}")
    if state.tau.shape != (S, H) or state.tau.dtype != torch.float32 or not state.tau.is_contiguous():
        raise ValueError(f"state.tau must be a contiguous float32 (S, H) = ({S}, {H}) tensor")
    ws = ws or WORKSPACES.shared(q.device)
    dev = q.device
    N = R * K * (2 if cfg.recall_successors else 1)  # support entries offered: R*K, and their successors
    N_pad = next_pow2(N + W, 16)  # candidate row width (M_t <= N + W)
    path = torch.empty(B, H, dtype=torch.int8, device=dev)
    max_sim = torch.empty(B, H, dtype=torch.float32, device=dev)
    n_scored = torch.empty(B, H, dtype=torch.int32, device=dev)
    cand = ws.get("cand", (B, H, N_pad), torch.int32)
    count = ws.get("cand_count", (B, H), torch.int32)  # M_t of the heads that reuse, else 0
    calibrate, guard, raise_tau = cfg.tau_calibration > 0, cfg.refresh_guard > 0, cfg.tau_guard > 0
    observe = calibrate or guard or raise_tau  # exact heads measure the recall reuse would have had
    cal_count = ws.get("cand_count_all", (B, H), torch.int32) if observe else count  # every head's M_t
    cand_scores = ws.get("cand_scores", (B, H, N_pad), torch.float32)
    at = ws.get("fifo_at", (B,), torch.long)  # each row's FIFO write position, for stage 3
    N_sort = next_pow2(N, 2)  # the selector sorts the recalled supports (and successors) only, not the window
    merged = ws.get("cand_merged", (B, H), torch.int8)  # 1: merge stages only (sorted runs), 0: full sort
    big = N_sort >= 1024
    selector_kernel[(B, H)](
        q, q.stride(0), q.stride(1), slots, kv.lengths,
        state.queries, state.support, state.fill, state.ptr, state.step, state.phase, state.period,
        path, max_sim, n_scored, cand, count, cal_count, at, merged,
        state.tau, cfg.refresh_every, H, C, K, W,
        R=R, RECENT=cfg.retrieval == "recent", D=D, BLOCK_D=next_pow2(D, 16), BLOCK_C=next_pow2(C, 2),
        N_PAD=N_pad, N_SORT=N_sort, BLOCK_W=next_pow2(W, 2), RUN=K if K & (K - 1) == 0 else 0,
        ALL_CAND=cfg.gqa_policy == "group", CALIBRATE=observe, GUARD=guard, SUCC=cfg.recall_successors,
        num_warps=8 if big else 4)
    if cfg.gqa_policy != "head":  # per-group verdicts on the device; only the final reuse heads keep candidates
        tau = state.tau.index_select(0, slots) if calibrate or raise_tau else None  # (B, H), as the torch path's
        path = gqa_paths(path, max_sim, kv.num_kv_heads, cfg, tau)
        count.masked_fill_(path != Path.REUSE, 0)  # cal_count keeps every head's M_t
        n_scored = torch.where(path == Path.REUSE, count, kv.lengths.to(torch.int32).view(B, 1))
    dense, exact_path = None, path
    if cfg.dense_below:  # the dense floor, decided on the device: rows with L < L_min take path DENSE
        dense = below_floor(kv.lengths, cfg).view(B, 1)  # (B, 1)
        path = torch.where(dense, torch.tensor(Path.DENSE, dtype=torch.int8, device=dev), path)
        count.masked_fill_(dense, 0)  # no candidates: the exact kernels give the FIFO its exact Top-K
        n_scored = torch.where(dense, kv.lengths.to(torch.int32).view(B, 1), n_scored)
        max_sim = max_sim.masked_fill(dense, float("nan"))
        # plain dense rows (L + C < L_min, their FIFO entries would be overwritten before L_min): no exact Top-K
        # here, and select + attend (by the same test) selects nothing and pushes nothing for them
        exact_path = path.masked_fill(plain_dense(kv.lengths, cfg).view(B, 1), Path.REUSE)
    block_m = 64
    indexed_qk_kernel[(B, H, triton.cdiv(N + W, block_m))](  # blocks up to the largest M_t
        q, q.stride(0), q.stride(1), kv.k_pool, kv.block_table, kv.block_table.stride(0), cand, count, cand_scores,
        float(scale), H, kv.num_kv_heads, kv.block_size, H // kv.num_kv_heads, N_pad,
        D=D, BLOCK_D=next_pow2(D, 16), BLOCK_M=block_m)
    keys = exact_topk_keys(q, kv, K, scale, ws, path=exact_path, chunk=chunk)  # (B, H, K_pad), non-reuse heads
    cal = (cal_count, max_sim, state.tau, calibration_constants(cfg)) if observe else None  # max_sim NaN: DENSE
    if guard:
        cal += ((state.period, guard_constants(cfg), cfg.refresh_every),)
    out, sel = _attend(q, kv, K, ws, keys, retopk=(path, cand, cand_scores, count, N_pad, slots, at, state,
                                                   cfg.dense_below), cal=cal)
    if dense is not None:  # dense rows attend to every position; a push row's FIFO entry is the exact Top-K above
        out = torch.where(dense.unsqueeze(-1), dense_attention(q, kv, scale, ws, below=cfg.dense_below), out)
    return StepOutput(out=out, path=path, max_sim=max_sim, n_scored=n_scored, selected=sel)


def _attend(q: torch.Tensor, kv: PagedKV, K: int, ws: Workspace, exact_keys: torch.Tensor, retopk, cal=None):
    B, H, D = q.shape
    DV = kv.v_pool.shape[-1]
    K_pad = exact_keys.shape[-1]
    out = torch.empty(B, H, DV, dtype=q.dtype, device=q.device)
    sel = torch.empty(B, H, K, dtype=torch.long, device=q.device)
    weights = ws.get("weights", (B, H, K_pad), torch.float32)
    if retopk is None:
        path = cand = cand_scores = count = slots = at = exact_keys  # unused (RETOPK=False)
        N_pad, queries, support, ptr, fill, step, C = 16, q, exact_keys, exact_keys, exact_keys, exact_keys, 1
        dense_below = 0
    else:
        path, cand, cand_scores, count, N_pad, slots, at, state, dense_below = retopk
        queries, support, C = state.queries, state.support, state.queries.shape[2]
        ptr, fill, step = state.ptr, state.fill, state.step
    cal_count, max_sim, tau, (target, rate, band, lo, hi, mass, r_target, r_margin) = \
        cal[:4] if cal else (exact_keys,) * 3 + ((0.0,) * 8,)
    guard = cal is not None and len(cal) > 4
    period, (g_target, g_fresh, g_lo), T_r = cal[4] if guard else (exact_keys, (0.0, 0.0, 1), 0)  # unused: GUARD off
    select_attend_kernel[(B, H)](
        q, q.stride(0), q.stride(1), kv.v_pool, kv.block_table, kv.block_table.stride(0),
        path, cand, cand_scores, count, exact_keys,
        sel, weights, out, out.stride(0), out.stride(1),
        slots, queries, support, at, ptr, fill, step, kv.lengths, dense_below,
        cal_count, max_sim, tau, target, rate, band, lo, hi, r_target, r_margin, period, g_target, g_fresh, int(g_lo),
        T_r,
        K, H, kv.num_kv_heads, kv.block_size, H // kv.num_kv_heads, C,
        K_PAD=K_pad, N_PAD=N_pad, D=D, BLOCK_D=next_pow2(D, 16), DV=DV, BLOCK_DV=next_pow2(DV, 16),
        BLOCK_KV=64, RETOPK=retopk is not None, CALIBRATE=cal is not None, GUARD=guard, RAISE=r_target > 0,
        MASS=bool(mass),
        LOG_N=N_pad.bit_length(),
        num_warps=8 if max(N_pad, K_pad) >= 1024 else 4)
    return out, sel
