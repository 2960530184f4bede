"""Stage 3, fused select + attend + FIFO update: one program per (sequence b, query head h).

Selection (eq. 11 on reuse, eq. 1 on exact paths):
    reuse head   Ŝ = TopK_{j < M} ê_j over the packed candidates (stage 2 scores), in tiles of K_PAD up to
                 the head's own M: each tile's keys join the running Top-K_PAD and one bitonic Top-K of
                 those 2 K_PAD keys keeps the best (M ~ 700-900 of N_PAD = 4096 at K = 512: two networks
                 of 1024 keys instead of one of 4096)
    exact head   Ŝ = the merged exact Top-K list of exact_support.py (already sorted)
Attention over Ŝ (eq. 12), keys' scores recomputed by nothing: the selection carries them,
    o = Σ_{i∈Ŝ} exp(e_i - m) v_i / Σ_{i∈Ŝ} exp(e_i - m),   m = max_{i∈Ŝ} e_i,
with values read from the PagedKV pool by position in blocks of BLOCK_KV. Outputs: o (q's dtype), the
selected positions (B, H, K) int64 sorted by score, -1 padded. With FIFO (ReTopK), the unit query
q̄ and Ŝ are also written into entry ``at[b]`` of this head's FIFO (the write pointer ptr[slot] the
selector copied before this launch), Ŝ sorted by position with the -1s after it (the selector's
merge-only path relies on it, after checking): a reuse head rescans its candidate tiles, which are in
position order, keeping the keys >= its K-th best key at a running prefix count (no sort); an exact
head sorts its K positions (one bitonic sort of K_PAD, beside its pass over all L keys). Head 0 of
each sequence advances that slot's counters as
``QuerySupportCache.advance`` and the torch step do:
    ptr = (at + 1) % C,   fill = min(fill + 1, C),   step = step + 1
(no other program of this launch reads them: the other heads take the copy, hence no race), which
saves the ~10 small torch ops per layer and step that did this after the launch. A plain dense row
(L + C < DENSE_BELOW, the torch path's test) selects nothing (``selected`` -1) and writes no FIFO
entry: only its step counter advances (the launcher takes its output from the dense kernel).

With CALIBRATE (``tau_calibration``), a head whose path is exact (not REUSE, not DENSE) and whose FIFO
is not empty (ρ_max > -inf) also moves its threshold as ``calibrate_tau`` does: the recall reuse would
have had, r = |Ŝ ∩ A_t| / |Ŝ| (``fidelity.support_recall``; A_t the selector's candidate row, sorted
ascending, of length cal_count: one vectorised binary search per selected position; with MASS,
``mass_recall``, r = Σ_{i∈Ŝ∩A_t} p_i with p the attention weights of Ŝ, ``fidelity.mass_recall``), gives
    tau_h <- min(max(tau_h + [|ρ_max - tau_h| < BAND] RATE (TARGET - r), LO), max(tau_h, HI))
(``calibration_constants``; TARGET 0: thresholds untouched; a tau that RAISE lifted past HI is its own ceiling),
then with RAISE (``tau_guard``), on a head whose ρ_max >= tau_h (the threshold before this step's move: it would
have reused), as ``guard_tau`` does:
    tau_h <- max(tau_h, min(ρ_max + R_MARGIN, 1)) if r < R_TARGET
written back to state.tau[slot, h] by the head's own program. With GUARD (``refresh_guard``) the same recall, on
a REFRESH head whose ρ_max >= tau_h (the threshold before this step's move), moves its refresh period as
``guard_period`` does:
    T_h <- max(T_h / 2, G_LO) if r < G_TARGET,  min(2 T_h, T_R) if r >= G_FRESH,  else T_h
(``guard_constants``), written back to state.period[slot, h]. CALIBRATE is on with any of the three.
"""

from __future__ import annotations

import triton
import triton.language as tl

from retopk_core.kernels.bitonic import EMPTY, POS_PAD, bitonic_sort, bitonic_topk, pack_key, unpack_pos, unpack_score
from retopk_core.kernels.paged import pool_rows


@triton.jit
def select_attend_kernel(q_ptr, stride_qb, stride_qh, v_ptr, table_ptr, stride_tb,
                         path_ptr, cand_ptr, cscore_ptr, count_ptr, exact_ptr,
                         sel_ptr, w_ptr, out_ptr, stride_ob, stride_oh,
                         slots_ptr, cq_ptr, sup_ptr, at_ptr, wptr_ptr, fill_ptr, step_ptr, len_ptr, DENSE_BELOW,
                         cal_count_ptr, maxsim_ptr, tau_ptr, TARGET, RATE, BAND, LO, HI, R_TARGET, R_MARGIN,
                         period_ptr, G_TARGET, G_FRESH, G_LO, T_R,
                         K, H, H_KV, P, G, C,
                         K_PAD: tl.constexpr, N_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_KV: tl.constexpr,
                         RETOPK: tl.constexpr, CALIBRATE: tl.constexpr, GUARD: tl.constexpr, RAISE: tl.constexpr,
                         MASS: tl.constexpr, LOG_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b * H + h
    r = tl.arange(0, K_PAD)
    plain = False
    if RETOPK:
        plain = tl.load(len_ptr + b) + C < DENSE_BELOW  # retopk_policy.plain_dense: no selection, no FIFO entry
        if plain:
            top = tl.full((K_PAD,), EMPTY, tl.int64)
        elif tl.load(path_ptr + row) == 0:
            n = tl.load(count_ptr + row)  # M_t <= N_PAD
            top = tl.full((K_PAD,), EMPTY, tl.int64)
            for j0 in range(0, n, K_PAD):  # only the tiles holding candidates
                j = j0 + r
                m = j < n
                pos = tl.load(cand_ptr + row * N_PAD + j, mask=m, other=0)
                e = tl.load(cscore_ptr + row * N_PAD + j, mask=m, other=0.0)
                both = tl.reshape(tl.join(top, tl.where(m, pack_key(e, pos), EMPTY)), [2 * K_PAD])
                top = bitonic_topk(both, K_PAD, True)
        else:
            top = tl.load(exact_ptr + row * K_PAD + r)
    else:
        top = tl.load(exact_ptr + row * K_PAD + r)
    valid = (top != EMPTY) & (r < K)
    e = tl.where(valid, unpack_score(top), float("-inf"))
    sel = tl.where(valid, unpack_pos(top), -1)  # (K_PAD,) int64
    m = tl.max(e, 0)
    p = tl.where(valid, tl.exp(e - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    p = p / tl.maximum(tl.sum(p, 0), 1.0)  # the sum is >= 1 (exp(0) at the max) unless nothing is selected (plain)
    if CALIBRATE:  # RETOPK only
        path = tl.load(path_ptr + row)
        rho = tl.load(maxsim_ptr + row)
        if (path != 0) & (path != 4) & (rho > float("-inf")):  # exact, not DENSE, FIFO not empty
            n = tl.load(cal_count_ptr + row)  # |A_t|
            x = sel.to(tl.int32)
            lo = tl.zeros((K_PAD,), tl.int32)
            hi = lo + n
            for _ in tl.static_range(LOG_N):  # lo <- the first index with A_t[lo] >= x
                go = lo < hi
                mid = (lo + hi) // 2
                v = tl.load(cand_ptr + row * N_PAD + mid, mask=go, other=0)
                right = go & (v < x)
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where(go & (v >= x), mid, hi)
            found = valid & (lo < n)
            hit = found & (tl.load(cand_ptr + row * N_PAD + lo, mask=found, other=-1) == x)
            if MASS:  # mass_recall: the support's softmax weight on A_t (p sums to 1 over a non-empty support)
                recall = tl.sum(tl.where(hit, p, 0.0), 0)
            else:
                recall = tl.sum(hit.to(tl.float32), 0) / tl.maximum(tl.sum(valid.to(tl.float32), 0), 1.0)
            tau_at = tau_ptr + tl.load(slots_ptr + b) * H + h
            th = tl.load(tau_at)
            tau_new = th
            if TARGET > 0:
                move = tl.where(tl.abs(rho - th) < BAND, RATE * (TARGET - recall), 0.0)
                tau_new = tl.minimum(tl.maximum(th + move, LO), tl.maximum(th, HI))
            if RAISE:  # it would have reused (by th, this step's threshold), and reuse would have missed
                raised = tl.maximum(tau_new, tl.minimum(rho + R_MARGIN, 1.0))
                tau_new = tl.where((rho >= th) & (recall < R_TARGET), raised, tau_new)
            tl.store(tau_at, tau_new)
            if GUARD:
                if (path == 2) & (rho >= th):  # a refresh where the head would have reused
                    per_at = period_ptr + tl.load(slots_ptr + b) * H + h
                    t_h = tl.load(per_at)
                    t_new = tl.where(recall < G_TARGET, tl.maximum(t_h // 2, G_LO),
                                     tl.where(recall >= G_FRESH, tl.minimum(t_h * 2, T_R), t_h))
                    tl.store(per_at, t_new)
    tl.store(sel_ptr + row * K + r, sel, mask=r < K)
    tl.store(w_ptr + row * K_PAD + r, p)
    tl.debug_barrier()  # the value loop below re-reads sel / p in blocks from other threads' writes
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for k0 in range(0, K, BLOCK_KV):
        i = k0 + tl.arange(0, BLOCK_KV)
        pi = tl.load(sel_ptr + row * K + i, mask=i < K, other=-1)
        wi = tl.load(w_ptr + row * K_PAD + i, mask=i < K, other=0.0)
        ok = pi >= 0
        rows = pool_rows(table_ptr, stride_tb, b, h // G, pi, ok, H_KV, P)
        v = tl.load(v_ptr + rows[:, None] * DV + dv[None, :], mask=ok[:, None] & (dv < DV)[None, :], other=0.0)
        acc += tl.sum(wi[:, None] * v.to(tl.float32), 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dv, acc.to(out_ptr.dtype.element_ty), mask=dv < DV)
    if RETOPK:
        slot = tl.load(slots_ptr + b)
        at = tl.load(at_ptr + b)
        if not plain:
            entry = (slot * H + h) * C + at
            d = tl.arange(0, BLOCK_D)
            q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
            qn = q / tl.maximum(tl.sqrt(tl.sum(q * q, 0)), 1e-12)
            tl.store(cq_ptr + entry * D + d, qn, mask=d < D)
            if tl.load(path_ptr + row) == 0:  # reuse: Ŝ by position, a prefix scan of the candidate row
                kth = tl.max(tl.where(r == K - 1, top, EMPTY), 0)  # the K-th best key (EMPTY: M_t < K)
                n = tl.load(count_ptr + row)
                base = 0
                for j0 in range(0, n, K_PAD):  # the rerank's tiles again, in position order
                    j = j0 + r
                    inside = j < n
                    pos = tl.load(cand_ptr + row * N_PAD + j, mask=inside, other=0)
                    e_j = tl.load(cscore_ptr + row * N_PAD + j, mask=inside, other=0.0)
                    keep = inside & (pack_key(e_j, pos) >= kth)
                    dest = base + tl.cumsum(keep.to(tl.int32), 0) - 1
                    tl.store(sup_ptr + entry * K + dest, pos.to(tl.int64), mask=keep & (dest < K))
                    base += tl.sum(keep.to(tl.int32), 0)
                tl.store(sup_ptr + entry * K + r, tl.full((K_PAD,), -1, tl.int64), mask=(r >= base) & (r < K))
            else:  # exact paths: their Top-K comes in score order, sorted by position once (K_PAD keys)
                by_pos = bitonic_sort(tl.where(valid, sel, POS_PAD).to(tl.int32))
                tl.store(sup_ptr + entry * K + r, tl.where(by_pos != POS_PAD, by_pos, -1).to(tl.int64), mask=r < K)
        if h == 0:  # the slot's counters, once per sequence
            if not plain:
                tl.store(wptr_ptr + slot, (at + 1) % C)
                tl.store(fill_ptr + slot, tl.minimum(tl.load(fill_ptr + slot) + 1, C))
            tl.store(step_ptr + slot, tl.load(step_ptr + slot) + 1)
