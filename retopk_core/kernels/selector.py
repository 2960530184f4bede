"""ReTopK stage 1, the fused selector: one program per (sequence b, query head h).

    q̄      = q / ||q||                                                  unit query
    ρ_c    = q̄ · q̄_c  for the fill_b valid FIFO entries, -inf elsewhere   (eq. 6)
    ρ_max  = max_c ρ_c;  R_t = TopR_c ρ_c (or the R newest entries)        (eq. 7)
    path   = REFRESH if T_r > 0, t > 0, (t + φ_h) % T_h == 0 or if t < 0 else FALLBACK if ρ_max < tau_h else REUSE
             (eq. 13; φ_h the head's refresh phase, 0 unless ``refresh_stagger``; T_h = state.period[slot, h] with
             GUARD (``refresh_guard``), else T_r; t < 0: a turn's first ``refresh_first`` steps)
    A_t    = Unique(∪_{c∈R_t} Ŝ_c ∪ {L-W, ..., L-1} ∩ [0, L))            (eq. 8, 9)
             with SUCC (``recall_successors``) also ∪ {p + 1 : p ∈ Ŝ_c, c ∈ R_t, p >= 0, p + 1 <= L - 1}

tau is the head's own threshold state.tau[slot, h] (every head's cfg.tau unless ``tau_calibration``
moves them). Written per head: path (int8, the head's own decision), ρ_max, n_scored (M_t on reuse, L
on exact paths), and for reuse heads the candidate positions sorted ascending and packed at the front
of a row of width N_PAD >= N + W (int32; N = R*K support entries, 2*R*K with SUCC) with their count M_t in
``count`` (0 for exact-path heads).
With ALL_CAND (the "group" GQA policy, where a head below tau may still reuse with its group)
fallback heads get candidates and a count too; the launcher then applies the policy on the device and
fixes count / n_scored. With CALIBRATE (``tau_calibration``, ``refresh_guard`` or ``tau_guard``) every head builds A_t,
whatever its path, and writes M_t to ``cal_count`` as well: stage 3 measures on the exact heads the recall reuse would
have had (``count`` stays the reuse heads' own, so the indexed QK and the reuse selection ignore them).
Head 0 of each sequence also copies the FIFO's write pointer ptr[slot] to ``at[b]``: stage 3 writes the
new entry there while it advances ptr itself.

Deduplication sorts only the N recalled support entries (N_SORT = next_pow2(N) keys: 2048 at
K = 512, R = 4, not next_pow2(R*K + W) = 4096 with half of them padding): with SUCC entry R*K + j is the
successor of entry j (runs R..2R-1 repeat runs 0..R-1 shifted by one; a successor past L - 1 or of -1
padding is padding itself, so a run sorted by position, -1s last, gives a sorted run of successors). The window
{w0, ..., L-1}, w0 = max(L-W, 0), is a run of consecutive positions that are candidates anyway, so
support entries inside it become w0 and are dropped after the sort (duplicates), -1 padding becomes
POS_PAD, and the window is written by arithmetic behind the kept entries below w0 (entries >= L, which
only a stale FIFO could hold, go after it, as a sort would place them). Then a neighbour comparison
and a prefix-sum compaction keep the first occurrences.

Supports are stored sorted by position, -1s last: select + attend writes them so (reuse heads by a
prefix scan of their position-ordered candidates, no sort; exact heads by one sort of K_PAD, 45 steps
at K = 512, beside their pass over all L keys) and so does the prefill of a Triton-backed method
(``retopk.by_position``; the torch and CPU steps write theirs in no such order). The map above is
monotone, so each recalled run of K then stays sorted. The selector checks it and never trusts it:
with K a power of two (constexpr RUN = K), odd runs are read back to front and one neighbour
comparison over N_SORT (run boundaries ignored) tells whether every run is sorted the way the bitonic
network's stage log K leaves them (even ascending, odd descending; padding runs are all POS_PAD). If
so only the merging stages run (``bitonic_merge_sort``: stages log K + 1 .. log N_SORT, 10 + 11 = 21
compare-exchange steps at K = 512, R = 4; 12 more with SUCC), else the full sort (66 steps; 78 with SUCC);
both give the same row, and
``merged`` records which ran (1 / 0; -1 for heads that build no candidates). K not a power of two:
always the full sort.
"""

from __future__ import annotations

import triton
import triton.language as tl

from retopk_core.kernels.bitonic import POS_PAD, bitonic_merge_sort, bitonic_sort


@triton.jit
def selector_kernel(q_ptr, stride_qb, stride_qh, slots_ptr, len_ptr,
                    cq_ptr, sup_ptr, fill_ptr, wptr_ptr, step_ptr, phase_ptr, period_ptr,
                    path_ptr, maxsim_ptr, nscored_ptr, cand_ptr, count_ptr, cal_count_ptr, at_ptr, merged_ptr,
                    tau_ptr, T_R, H, C, K, W,
                    R: tl.constexpr, RECENT: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_C: tl.constexpr, N_PAD: tl.constexpr, N_SORT: tl.constexpr, BLOCK_W: tl.constexpr,
                    RUN: tl.constexpr, ALL_CAND: tl.constexpr, CALIBRATE: tl.constexpr, GUARD: tl.constexpr,
                    SUCC: tl.constexpr):
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
    if GUARD:  # the head's own refresh period (refresh_guard; >= 1, checked by the launcher's caller)
        refresh = (T_R > 0) & (step > 0) & ((step + tl.load(phase_ptr + h)) % tl.load(period_ptr + slot * H + h) == 0)
    else:
        refresh = (T_R > 0) & (step > 0) & ((step + tl.load(phase_ptr + h)) % tl.maximum(T_R, 1) == 0)
    refresh = refresh | (step < 0)  # a turn's first refresh_first steps (the prefill set t_dec to -N)
    path = tl.where(refresh, 2, tl.where(max_sim < tl.load(tau_ptr + slot * H + h), 1, 0))
    row = b * H + h
    tl.store(path_ptr + row, path.to(tl.int8))
    tl.store(maxsim_ptr + row, max_sim)
    if h == 0:  # read by stage 3, which moves ptr[slot] on (the other heads here still read it)
        tl.store(at_ptr + b, tl.load(wptr_ptr + slot))
    reusable = (path == 0) | (ALL_CAND & (path == 1))  # may reuse: gets M_t in count
    if reusable | CALIBRATE:
        # recall: entry id and validity of each of the R recalled entries, spread over their K slots (SUCC: twice,
        # runs r and R + r)
        i = tl.arange(0, N_SORT)
        r_of = i // K
        if SUCC:
            src = tl.where(r_of >= R, r_of - R, r_of)  # the recalled entry a run reads (>= R: padding runs)
        else:
            src = r_of
        rid = tl.zeros((N_SORT,), tl.int64)
        rok = tl.zeros((N_SORT,), tl.int1)
        work = sim
        for r in tl.static_range(R):
            if RECENT:
                idx = ((tl.load(wptr_ptr + slot) - r - 1) % C + C) % C
                ok = r + 1 <= fill
            else:
                ok = tl.max(work, 0) > float("-inf")
                idx = tl.argmax(work, 0)
                work = tl.where(c == idx, float("-inf"), work)
            rid = tl.where(src == r, idx, rid)
            rok = tl.where(src == r, ok, rok)
        w = i % K  # slot in the run
        if RUN > 0:  # odd runs read back to front: stored ascending, the merge stages want them descending
            w = tl.where(r_of % 2 == 1, K - 1 - w, w)
        if SUCC:
            n_ent = 2 * R * K
        else:
            n_ent = R * K
        sup = tl.load(sup_ptr + ((slot * H + h) * C + rid) * K + w, mask=(i < n_ent) & rok, other=-1)
        if SUCC:  # runs R.. hold p + 1 <= L - 1 of their entry's positions p >= 0, else padding
            sup = tl.where((i >= R * K) & (sup >= 0), tl.where(sup + 1 < L, sup + 1, -1), sup)
        w0 = tl.maximum(L - W, 0)  # the window {w0, ..., L-1}
        n_win = (L - w0).to(tl.int32)
        # entries inside the window are its duplicates: they become w0 (dropped below), -1 padding POS_PAD;
        # a monotone map, so a run stored by position (-1s last) stays sorted
        cand = tl.where(sup < 0, POS_PAD, tl.where((sup >= w0) & (sup < L), w0, sup)).to(tl.int32)
        if RUN > 0:  # merge stages only when every recalled run is sorted (checked: the FIFO is not trusted)
            prev = tl.gather(cand, tl.maximum(i - 1, 0), 0)
            unsorted = (i % K != 0) & tl.where(r_of % 2 == 1, prev < cand, prev > cand)
            merged = tl.sum(unsorted.to(tl.int32), 0) == 0
            if merged:
                cand = bitonic_merge_sort(cand, RUN)
            else:
                cand = bitonic_sort(cand)
            tl.store(merged_ptr + row, merged.to(tl.int8))
        else:
            cand = bitonic_sort(cand)
            tl.store(merged_ptr + row, 0)
        prev = tl.gather(cand, tl.maximum(i - 1, 0), 0)
        keep = (cand != POS_PAD) & ((cand < w0) | (cand >= L)) & ((i == 0) | (cand != prev))
        dest = tl.cumsum(keep.to(tl.int32), 0) - 1 + tl.where(cand >= L, n_win, 0)  # >= L: behind the window
        tl.store(cand_ptr + row * N_PAD + dest, cand, mask=keep)
        n_below = tl.sum((keep & (cand < w0)).to(tl.int32), 0)
        wj = tl.arange(0, BLOCK_W)
        tl.store(cand_ptr + row * N_PAD + n_below + wj, (w0 + wj).to(tl.int32), mask=wj < n_win)
        count = tl.sum(keep.to(tl.int32), 0) + n_win
        tl.store(count_ptr + row, tl.where(reusable, count, 0))
        tl.store(nscored_ptr + row, tl.where(reusable, count, L.to(tl.int32)))
        if CALIBRATE:
            tl.store(cal_count_ptr + row, count)
    else:
        tl.store(count_ptr + row, 0)
        tl.store(nscored_ptr + row, L.to(tl.int32))
        tl.store(merged_ptr + row, -1)
