"""ReTopK stage 1, the fused selector: one program per (sequence b, query head h).

    q̄      = q / ||q||                                                  unit query
    ρ_c    = q̄ · q̄_c  for the fill_b valid FIFO entries, -inf elsewhere   (eq. 6)
    ρ_max  = max_c ρ_c;  R_t = TopR_c ρ_c (or the R newest entries)        (eq. 7)
    path   = REFRESH if T_r > 0, t > 0, (t + φ_h) % T_r == 0 else FALLBACK if ρ_max < tau else REUSE (eq. 13;
             φ_h the head's refresh phase, 0 unless ``refresh_stagger``)
    A_t    = Unique(∪_{c∈R_t} Ŝ_c ∪ {L-W, ..., L-1} ∩ [0, L))            (eq. 8, 9)

Written per head: path (int8, the head's own decision), ρ_max, n_scored (M_t on reuse, L on exact
paths), and for reuse heads the candidate positions sorted ascending and packed at the front of a row
of width N_PAD (int32) with their count M_t (0 for exact-path heads). With ALL_CAND (the "group" GQA
policy, where a head below tau may still reuse with its group) fallback heads get candidates too; the
launcher then applies the policy on the device and fixes count / n_scored. Deduplication: a bitonic
sort, a neighbour comparison, then a prefix-sum compaction of the first occurrences.
"""

from __future__ import annotations

import triton
import triton.language as tl

from retopk_core.kernels.bitonic import POS_PAD, bitonic_sort


@triton.jit
def _selector_kernel(q_ptr, stride_qb, stride_qh, slots_ptr, len_ptr,
                     cq_ptr, sup_ptr, fill_ptr, wptr_ptr, step_ptr, phase_ptr,
                     path_ptr, maxsim_ptr, nscored_ptr, cand_ptr, count_ptr,
                     tau, T_R, H, C, K, W,
                     R: tl.constexpr, RECENT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_C: tl.constexpr, N_PAD: tl.constexpr, ALL_CAND: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    L = tl.load(len_ptr + b)
    fill = tl.load(fill_ptr + slot)
    step = tl.load(step_ptr + slot)
    d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    qn = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12)
    c = tl.arange(0, BLOCK_C)
    entry = (slot * H + h) * C + c  # FIFO entries of this (slot, head)
    cq = tl.load(cq_ptr + entry[:, None] * D + d[None, :], mask=(c < C)[:, None] & (d < D)[None, :], other=0.0)
    sim = tl.where(c < fill, tl.sum(cq * qn[None, :], 1), float("-inf"))  # (BLOCK_C,)
    max_sim = tl.max(sim, 0)
    refresh = (T_R > 0) & (step > 0) & ((step + tl.load(phase_ptr + h)) % tl.maximum(T_R, 1) == 0)
    path = tl.where(refresh, 2, tl.where(max_sim < tau, 1, 0))
    row = b * H + h
    tl.store(path_ptr + row, path.to(tl.int8))
    tl.store(maxsim_ptr + row, max_sim)
    if (path == 0) | (ALL_CAND & (path == 1)):
        # recall: entry id and validity of each of the R recalled entries, spread over their K slots
        i = tl.arange(0, N_PAD)
        r_of = i // K
        rid = tl.zeros((N_PAD,), tl.int64)
        rok = tl.zeros((N_PAD,), tl.int1)
        work = sim
        for r in tl.static_range(R):
            if RECENT:
                idx = ((tl.load(wptr_ptr + slot) - r - 1) % C + C) % C
                ok = r + 1 <= fill
            else:
                ok = tl.max(work, 0) > float("-inf")
                idx = tl.argmax(work, 0)
                work = tl.where(c == idx, float("-inf"), work)
            rid = tl.where(r_of == r, idx, rid)
            rok = tl.where(r_of == r, ok, rok)
        in_sup = i < R * K
        sup = tl.load(sup_ptr + ((slot * H + h) * C + rid) * K + i % K, mask=in_sup & rok, other=-1)
        wpos = L - W + (i - R * K)
        in_win = (i >= R * K) & (i < R * K + W)
        cand = tl.where(in_sup, sup, tl.where(in_win, wpos, -1))
        cand = tl.where(cand >= 0, cand, POS_PAD).to(tl.int32)
        cand = bitonic_sort(cand)
        prev = tl.gather(cand, tl.maximum(i - 1, 0), 0)
        keep = (cand != POS_PAD) & ((i == 0) | (cand != prev))
        dest = tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(cand_ptr + row * N_PAD + dest, cand, mask=keep)
        count = tl.sum(keep.to(tl.int32), 0)
        tl.store(count_ptr + row, count)
        tl.store(nscored_ptr + row, count)
    else:
        tl.store(count_ptr + row, 0)
        tl.store(nscored_ptr + row, L.to(tl.int32))
