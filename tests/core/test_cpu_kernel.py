"""ReTopK's fused CPU kernel (backend "cpu") against the torch path and the per-head reference loop.

Both backends start from the same prefilled state and decode the same trace; after every step the
outputs (paths, max_sim, n_scored, selected sets, attention output) and the whole state of every slot
in use (queries, support sets, ptr, fill, step, tau, period; as ``read_slot`` exports it) must agree.
The traces are those of tests/core/test_retopk.py.
"""

from __future__ import annotations

import copy
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from retopk_core.cpu import build, launch
from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method
from tests.core._scenario import make_trace, paged
from tests.core.test_retopk import (
    assert_case_exercised,
    assert_step_matches_reference,
    case_scenario,
    every_case,
    run_both,
)

needs_kernel = pytest.mark.skipif(not launch.available(),
                                  reason="fused CPU kernel not built: run `python -m retopk_core.cpu.build`")


def exported(state, slots: torch.Tensor) -> SimpleNamespace:
    """The state of ``slots`` (B,) as ``read_slot`` exports it: field f -> (B, *f's per-slot shape). Not the pool's
    tensors themselves: a grown pool's free slots, and the FIFO rows at or past fill, hold whatever their memory
    held (QuerySupportCache._rows)."""
    per_slot = [state.read_slot(int(s)) for s in slots]
    return SimpleNamespace(**{name: torch.stack([t[name] for t in per_slot]) for name in state.fields})


def twin_run(cfg: dict, trace, H: int, H_kv: int, use_paged=False, dtype=torch.float32, no_prefill=False,
             strided_q=False, q_dtype=None):
    """Yield per step (torch StepOutput, cpu StepOutput, torch state, cpu state) over the same trace, each state
    ``exported`` (slot b of row b); keys and values in ``dtype``, queries in ``q_dtype`` (default: ``dtype``)."""
    B, d = len(trace.prompt_lens), trace.keys.shape[-1]
    methods = {name: make_method("retopk", backend=name, **cfg) for name in ("torch", "cpu")}
    state = methods["torch"].init_state(H, H_kv, d, capacity=1)  # grows while allocating B slots
    slots = torch.tensor([state.alloc() for _ in range(B)])
    keys, values = trace.keys.to(dtype), trace.values.to(dtype)
    T = trace.prompt_queries.shape[2]
    for b, P in enumerate(trace.prompt_lens):
        if not no_prefill:
            kv_b = PagedKV.contiguous(keys[b:b + 1], values[b:b + 1], torch.tensor([P]))
            methods["torch"].prefill(state, int(slots[b]), trace.prompt_queries[b].to(dtype),
                                     torch.arange(P - T, P).clamp(min=0), kv_b)
    states = {"torch": state, "cpu": copy.deepcopy(state)}
    for t in range(trace.queries.shape[0]):
        lengths = trace.lengths_at(t)
        if use_paged:  # shuffled 8-position blocks (paged() builds float32 pools: cast the rounded values back)
            kv = paged(keys.float(), values.float(), lengths, block=8, seed=t)
            kv = PagedKV(kv.k_pool.to(dtype), kv.v_pool.to(dtype), kv.block_table, kv.lengths)
        else:
            kv = PagedKV.contiguous(keys, values, lengths)
        q = trace.queries[t].to(q_dtype or dtype)
        if strided_q:  # as the runner passes it: a view into (B, H, 1, d) with padding around
            q = torch.zeros(B, H, 3, d, dtype=dtype).index_copy(2, torch.tensor([1]), q.unsqueeze(2))[:, :, 1]
        outs = {name: methods[name].decode(q, kv, states[name], slots) for name in ("torch", "cpu")}
        yield outs["torch"], outs["cpu"], exported(states["torch"], slots), exported(states["cpu"], slots)


def assert_same_step(a, b, sa, sb, tol: float = 1e-5) -> None:
    """Two StepOutputs and the states after them (``exported``) agree (selected and supports as sets)."""
    assert torch.equal(a.path, b.path), (a.path, b.path)
    assert a.max_sim.dtype == b.max_sim.dtype == torch.float32
    assert torch.equal(torch.isinf(a.max_sim), torch.isinf(b.max_sim))
    finite = torch.isfinite(a.max_sim)
    torch.testing.assert_close(b.max_sim[finite], a.max_sim[finite], atol=1e-5, rtol=1e-5)
    assert b.n_scored.dtype == torch.int32 and torch.equal(a.n_scored, b.n_scored), (a.n_scored, b.n_scored)
    assert b.selected.dtype == torch.int64
    assert torch.equal(a.selected.sort(-1).values, b.selected.sort(-1).values)
    assert b.out.dtype == a.out.dtype and b.out.shape == a.out.shape
    torch.testing.assert_close(b.out.float(), a.out.float(), atol=tol, rtol=tol)
    for name in ("fill", "ptr", "step"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    torch.testing.assert_close(sb.queries, sa.queries, atol=1e-6, rtol=1e-6)
    assert torch.equal(sa.support.sort(-1).values, sb.support.sort(-1).values)
    torch.testing.assert_close(sb.tau, sa.tau, atol=1e-6, rtol=0)  # per-head thresholds (tau_calibration)
    assert torch.equal(sa.period, sb.period), (sa.period, sb.period)  # per-head refresh periods (refresh_guard)


def beyond_bound(out, cfg) -> bool:
    """Some reuse head scored more candidates than R*K + W, which only recall_successors' p + 1 can give."""
    reuse = out.path == Path.REUSE
    return bool((out.n_scored[reuse] > cfg["recall"] * cfg["top_k"] + cfg["window"]).any())


@needs_kernel
@pytest.mark.parametrize("successors", [False, True], ids=["supports", "successors"])
@pytest.mark.parametrize("use_paged", [False, True])
@every_case
def test_matches_torch_path(case, policy, use_paged, successors):
    """Every case and GQA policy, with ``recall_successors`` too (A_t also holds each recalled p + 1: the same
    candidate counts n_scored and selections as the torch code's)."""
    cfg, trace = case_scenario(case, policy, recall_successors=successors)
    assert make_method("retopk", backend="cpu", **cfg).steps.name == "cpu"  # the kernel's own step, not torch's
    seen, grown = set(), False
    for a, b, sa, sb in twin_run(cfg, trace, case[0], case[1], use_paged):
        assert_same_step(a, b, sa, sb)
        seen |= set(b.path.flatten().tolist())
        grown |= beyond_bound(b, cfg)
    assert_case_exercised(seen, case, policy)
    assert not grown or successors


@needs_kernel
@pytest.mark.parametrize("mass", [False, True], ids=["support", "mass"])
@pytest.mark.parametrize("policy", [("head", 0.0), ("promote", 0.0), ("group", 0.0)], ids=["head", "promote", "group"])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["mha", "gqa3", "gqa7"])
def test_calibrated_tau_matches_torch_path(case, policy, mass):
    """tau_calibration in the kernel: the would-be reuse recall of its exact heads (``mass_recall``: the
    support's softmax weight reuse keeps) moves state.tau as the torch path's calibrate_tau does, step by step
    (the thresholds are compared in assert_same_step)."""
    from tests.core.test_retopk import CASES

    case = CASES[case]
    cfg, _ = case_scenario(case, policy, tau_calibration=0.8, mass_recall=mass)
    cfg["tau"] = 0.8
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=24,
                       T=case[4] + 2, noise=0.4)
    moved = False
    for a, b, sa, sb in twin_run(cfg, trace, case[0], case[1], use_paged=True):
        assert_same_step(a, b, sa, sb)
        moved |= bool((sb.tau != 0.8).any())
    assert moved


@needs_kernel
@pytest.mark.parametrize("mass", [False, True], ids=["support", "mass"])
@pytest.mark.parametrize("calibration", [0.0, 0.8], ids=["fixed-tau", "calibrated"])
@pytest.mark.parametrize("policy", [("head", 0.0), ("promote", 0.0), ("group", 0.0)], ids=["head", "promote", "group"])
@pytest.mark.parametrize("case", [0, 1, 2], ids=["mha", "gqa3", "gqa7"])
def test_refresh_guard_matches_torch_path(case, policy, calibration, mass):
    """refresh_guard in the kernel: per-head refresh periods decide the refreshes and move by the would-be
    reuse recall (``mass_recall``: weight) of the refreshes that would have reused, as the torch path's
    guard_period does, step by step (state.period compared in assert_same_step); the periods really moved."""
    from tests.core.test_retopk import CASES

    case = CASES[case]
    cfg, _ = case_scenario(case, policy, tau_calibration=calibration, refresh_guard=0.8, mass_recall=mass)
    cfg.update(tau=0.8, refresh_every=8)
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=40,
                       T=case[4] + 2, noise=0.4)
    periods = set()
    for a, b, sa, sb in twin_run(cfg, trace, case[0], case[1], use_paged=True):
        assert_same_step(a, b, sa, sb)
        periods |= set(sb.period.flatten().tolist())
    assert {1, 8} <= periods and len(periods) > 2, periods  # from the floor up to T_r, through the levels


# (tau_calibration, refresh_guard, mass_recall, tau_guard_margin): the guard alone, under calibration (whose ceiling
# keeps a raised tau), under the period guard, and all three with mass recall
GUARDED = [(0.0, 0.0, False, 0.05), (0.8, 0.0, False, 0.05), (0.0, 0.8, False, 0.02), (0.8, 0.8, True, 0.02)]


@needs_kernel
@pytest.mark.parametrize("successors", [False, True], ids=["supports", "successors"])
@pytest.mark.parametrize("calibration,refresh_guard,mass,margin", GUARDED,
                         ids=["guard", "calibrated", "period-guard", "all-mass"])
@pytest.mark.parametrize("case,policy", [(0, ("head", 0.0)), (1, ("group", 0.0))], ids=["mha-head", "gqa3-group"])
def test_tau_guard_matches_torch_path(case, policy, calibration, refresh_guard, mass, margin, successors):
    """tau_guard in the kernel: an exact head that would have reused (ρ_max >= its tau) and whose would-be reuse
    recall misses r_t has its tau raised to ρ_max + margin, after calibration, whose ceiling is then that raised tau;
    paths, selections, n_scored and state.tau equal the torch path's step by step (assert_same_step), some tau
    rose above tau0, and (calibrated) calibration observed a head whose tau stood above tau0. With
    ``recall_successors`` the would-be recall those rules measure is over the same A_t, successors included."""
    from tests.core.test_retopk import CASES

    case = CASES[case]
    cfg, _ = case_scenario(case, policy, tau_calibration=calibration, refresh_guard=refresh_guard, mass_recall=mass,
                           tau_guard=0.9, tau_guard_margin=margin, recall_successors=successors)
    cfg.update(tau=0.8, refresh_every=4)
    B = len(case[8])
    trace = make_trace(B=B, H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=24, T=case[4] + 2,
                       noise=0.4)
    assert make_method("retopk", backend="cpu", **cfg).steps.name == "cpu"  # the kernel's own step, not torch's
    raised, above_observed, before = False, False, None
    for a, b, sa, sb in twin_run(cfg, trace, case[0], case[1], use_paged=True):
        assert_same_step(a, b, sa, sb)
        raised |= bool((sb.tau > 0.8 + 1e-6).any())
        if before is not None:  # a calibration observation (exact, within the band) of a tau above tau0
            near = (a.path != Path.REUSE) & ((a.max_sim - before).abs() < 0.05)
            above_observed |= bool((near & (before > 0.8 + 1e-6)).any())
        before = sb.tau[:B].clone()  # slots 0..B-1: the thresholds the next step decides with
    assert raised
    assert above_observed or not calibration


@needs_kernel
@every_case
def test_matches_reference_loop(case, policy):
    """The kernel against the per-head reference written from the paper (no code shared with either backend)."""
    cfg, trace = case_scenario(case, policy, backend="cpu")
    for out, rows in run_both(cfg, trace, case[0], case[1], use_paged=True):
        assert_step_matches_reference(out, rows)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_paged", [False, True])
def test_half_precision_kv_matches_torch_path(dtype, use_paged):
    cfg = dict(top_k=16, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=5, gqa_policy="promote")
    trace = make_trace(B=3, H=6, H_kv=2, d=32, prompt_lens=(40, 20, 9), steps=10, T=6)
    for a, b, sa, sb in twin_run(cfg, trace, 6, 2, use_paged, dtype=dtype):
        assert b.out.dtype == dtype
        assert_same_step(a, b, sa, sb, tol=2e-2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("use_paged", [False, True])
def test_16_bit_kv_with_float32_queries_matches_torch_path_at_float32_tolerance(dtype, use_paged):
    """The runtime's setting: float32 queries over a 16-bit KV cache. Both backends widen the same 16-bit
    values exactly and accumulate in float32, so paths, selected sets and the whole state must agree and
    the outputs within float32 rounding, as tightly as with a float32 cache."""
    cfg = dict(top_k=16, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=5, gqa_policy="promote")
    trace = make_trace(B=3, H=6, H_kv=2, d=32, prompt_lens=(40, 20, 9), steps=10, T=6)
    for a, b, sa, sb in twin_run(cfg, trace, 6, 2, use_paged, dtype=dtype, q_dtype=torch.float32):
        assert b.out.dtype == torch.float32
        assert_same_step(a, b, sa, sb)


def exact_in_16_bits(x: torch.Tensor) -> torch.Tensor:
    """x rounded to a multiple of 1/64 below 4 in magnitude: at most 8 significant bits, exact in bfloat16 and
    float16 alike."""
    return (x * 64).round().clamp(-255, 255) / 64


@needs_kernel
@pytest.mark.parametrize("d", [12, 32, 60, 64])
def test_float16_pool_gives_the_bits_of_a_wider_pool_of_the_same_values(d):
    """The kernel widens either 16-bit format exactly and sums the widened values in the lanes of one other pool's
    loops: where its float16 dot products widen by F16C (``f16c_gathers``: an x86-64-v3 CPU), a float32 pool's
    (F16C into float32 rows, then float32's loops), else a bfloat16 pool's (half_bits_to_float inside the same
    vectorized loops as a bfloat16 value's shift). So a float16 pool and that pool holding the same values (exact in
    all three formats) give the same bits: every step's outputs and state, over reuse, fallback and refresh steps,
    d % 8 == 0 and d % 8 != 0 (the vector loops' tails, the scalar ones)."""
    twin = torch.float32 if launch.extension().f16c_gathers() else torch.bfloat16
    cfg = dict(top_k=16, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=5, gqa_policy="promote")
    trace = make_trace(B=3, H=6, H_kv=2, d=d, prompt_lens=(40, 20, 9), steps=12, T=6)
    keys, values = exact_in_16_bits(trace.keys), exact_in_16_bits(trace.values)
    method = make_method("retopk", backend="cpu", **cfg)
    state = method.init_state(6, 2, d, capacity=3)
    slots = torch.tensor([state.alloc() for _ in range(3)])
    dtypes = (torch.float16, twin)
    states = {dt: copy.deepcopy(state) for dt in dtypes}
    paths = set()
    for t in range(trace.queries.shape[0]):
        kv = paged(keys, values, trace.lengths_at(t), block=8, seed=t)  # float32 pools of values exact in 16 bits
        a, b = (method.decode(trace.queries[t], PagedKV(kv.k_pool.to(dt), kv.v_pool.to(dt), kv.block_table,
                                                        kv.lengths), states[dt], slots) for dt in dtypes)
        for name in ("out", "max_sim", "path", "n_scored"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (t, name)
        assert torch.equal(a.selected.sort(-1).values, b.selected.sort(-1).values), t
        sa, sb = (exported(states[dt], slots) for dt in dtypes)
        for name in state.fields:
            assert torch.equal(getattr(sa, name), getattr(sb, name)), (t, name)
        paths |= set(a.path.flatten().tolist())
    assert {Path.REUSE, Path.FALLBACK, Path.REFRESH} <= paths


@needs_kernel
@pytest.mark.parametrize("retrieval", ["similarity", "recent"])
def test_recent_retrieval_and_strided_query(retrieval):
    cfg = dict(top_k=8, cache_size=5, window=4, recall=2, tau=0.85, refresh_every=4, retrieval=retrieval)
    trace = make_trace(B=2, H=4, H_kv=2, prompt_lens=(30, 17), steps=10, T=7)
    for a, b, sa, sb in twin_run(cfg, trace, 4, 2, use_paged=True, strided_q=True):
        assert_same_step(a, b, sa, sb)


@needs_kernel
@pytest.mark.parametrize("successors", [False, True], ids=["supports", "successors"])
def test_empty_cache_then_reuse_and_head_dim_not_a_multiple_of_8(successors):
    """No prefill: every head falls back first (max_sim = -inf), the second step recalls one entry of R = 2
    (``recall_successors``: and its successors); d = 12 takes the scalar dot products."""
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=0, recall_successors=successors)
    trace = make_trace(B=2, H=6, H_kv=3, d=12, prompt_lens=(30, 17), steps=8, outlier_p=0.0)
    outs = []
    for a, b, sa, sb in twin_run(cfg, trace, 6, 3, no_prefill=True):
        assert_same_step(a, b, sa, sb)
        outs.append(b)
    assert (outs[0].path == Path.FALLBACK).all() and (outs[0].max_sim == -math.inf).all()
    assert (torch.stack([o.path for o in outs[1:]]) == Path.REUSE).any()


@needs_kernel
@pytest.mark.parametrize("d", [8, 24, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_pass_head_dims_and_head_counts(d, dtype):
    """The exact pass's vector dot products: d % 16 == 8 (a half chunk after the paired ones) and
    d % 16 == 0, with 7 heads of a group taking the exact path together (head runs of 3, 3, 1) on
    refresh steps and 1-2 heads on fallbacks."""
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=3)
    trace = make_trace(B=2, H=14, H_kv=2, d=d, prompt_lens=(70, 41), steps=7, T=6)
    paths = set()
    for a, b, sa, sb in twin_run(cfg, trace, 14, 2, use_paged=True, dtype=dtype):
        assert_same_step(a, b, sa, sb, tol=1e-5 if dtype == torch.float32 else 2e-2)
        paths |= set(b.path.flatten().tolist())
    assert {Path.REFRESH, Path.FALLBACK, Path.REUSE} <= paths


@needs_kernel
@pytest.mark.parametrize("calibration", [0.0, 0.8], ids=["fixed-tau", "calibrated"])
@pytest.mark.parametrize("policy", ["head", "group"])
def test_successors_of_a_crafted_fifo(policy, calibration):
    """recall_successors on a crafted FIFO: a (stale) support at L - 1, whose successor L lies past the history
    and is no candidate, one at L - 2 (its successor L - 1, the current token), successors inside the window and
    of a support past it, repeats, -1 padding (no successor), fewer entries than R in one row. The kernel's paths,
    n_scored (counted here by hand from the sets) and selections equal the torch code's; no selected position
    reaches L."""
    K, C, W, R, d, H, H_kv = 6, 4, 3, 3, 16, 4, 2
    cfg = dict(top_k=K, cache_size=C, window=W, recall=R, tau=0.5, refresh_every=0, gqa_policy=policy,
               recall_successors=True, tau_calibration=calibration)
    lengths = torch.tensor([30, 12])
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, H_kv, 30, d, generator=g), torch.randn(2, H_kv, 30, d, generator=g)
    methods = {name: make_method("retopk", backend=name, **cfg) for name in ("torch", "cpu")}
    assert methods["cpu"].steps.name == "cpu"
    state = methods["torch"].init_state(H, H_kv, d, capacity=2)
    slots = torch.tensor([state.alloc(), state.alloc()])
    state.queries[:] = torch.nn.functional.normalize(torch.randn(2, H, C, d, generator=g), dim=-1)
    sup = torch.full((2, H, C, K), -1, dtype=torch.long)
    sup[0, :, 0] = torch.tensor([29, 28, 3, 4, 10, -1])  # 29 = L - 1: successor 30 dropped; 28 -> 29 (the window)
    sup[0, :, 1] = torch.tensor([5, 3, 17, 16, 26, 0])  # 3 -> 4 repeats; 26 -> 27 in the window {27, 28, 29}
    sup[0, :, 2] = torch.tensor([20, 21, 22, -1, -1, -1])
    sup[0, :, 3] = torch.tensor([1, 2, 6, 7, 8, 9])
    sup[1, :, 0] = torch.tensor([11, 0, 5, 6, -1, -1])  # L = 12: 11 = L - 1 (stale)
    sup[1, :, 1] = torch.tensor([10, 7, 1, -1, -1, -1])  # 10 -> 11 = L - 1, the current token
    state.support[:] = sup
    state.fill[:] = torch.tensor([C, 2])  # row 1 holds 2 < R entries
    state.ptr[:] = torch.tensor([0, 2])
    state.step[:] = 1
    q = 2 * state.queries[:, :, 0] + 0.1 * torch.randn(2, H, d, generator=g)  # near entry 0: reuse
    q[0, 1] = torch.randn(d, generator=g)  # a fresh head: a fallback (group: maybe reused with its group)
    kv = paged(keys, values, lengths, block=8, seed=1)
    states = {"torch": state, "cpu": copy.deepcopy(state)}
    outs = {name: methods[name].decode(q, kv, states[name], slots) for name in ("torch", "cpu")}
    a, b = outs["torch"], outs["cpu"]
    assert_same_step(a, b, exported(states["torch"], slots), exported(states["cpu"], slots))
    assert (b.selected < lengths.view(2, 1, 1)).all()
    assert bool((b.path == Path.REUSE).all()) if policy == "group" else bool((b.path == Path.FALLBACK).sum() == 1), \
        b.path  # group: the fresh head reuses with its group's candidates; head: it falls back (calibration measures)
    order = (-torch.nn.functional.normalize(q, dim=-1).unsqueeze(2).mul(state.queries).sum(-1)).argsort(-1)  # (2, H, C)
    for bb, L in enumerate(lengths.tolist()):
        for hh in range(H):
            if b.path[bb, hh] != Path.REUSE:
                continue
            recalled = [c for c in order[bb, hh].tolist() if c < int(state.fill[bb])][:R]
            cand = set(range(max(0, L - W), L))
            for c in recalled:
                pos = [p for p in sup[bb, hh, c].tolist() if p >= 0]
                cand |= set(pos) | {p + 1 for p in pos if p + 1 < L}
            assert int(b.n_scored[bb, hh]) == len(cand), (bb, hh)


@needs_kernel
def test_dense_floor_rows_and_sparse_rows_in_one_batch():
    """dense_below splits the batch: short rows attend densely (torch), the others go through the kernel."""
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=0, dense_below=24)
    trace = make_trace(B=3, H=4, H_kv=2, prompt_lens=(40, 10, 25), steps=8, T=6)
    seen = set()
    for a, b, sa, sb in twin_run(cfg, trace, 4, 2, use_paged=True):
        assert_same_step(a, b, sa, sb)
        seen |= set(b.path.flatten().tolist())
    assert Path.DENSE in seen and Path.REUSE in seen


@needs_kernel
@pytest.mark.parametrize("policy", ["head", "group"])
def test_staggered_refresh_matches_torch_path(policy):
    """refresh_stagger: each KV group refreshes at its own phase, in the kernel as in the torch code."""
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=4, refresh_stagger=True,
               gqa_policy=policy)
    trace = make_trace(B=2, H=6, H_kv=3, prompt_lens=(40, 23), steps=10, T=6)
    refreshed = []  # (step, b, group) with a refresh
    for t, (a, b, sa, sb) in enumerate(twin_run(cfg, trace, 6, 3)):
        assert_same_step(a, b, sa, sb)
        refreshed += [(t, i, g) for i in range(2) for g in range(3) if bool(b.path[i, 2 * g] == Path.REFRESH)]
    steps_of = {g: {t for t, _, gg in refreshed if gg == g} for g in range(3)}
    assert steps_of[0] and steps_of[1] and steps_of[0] != steps_of[1]  # phases 0 and T_r / 2 (layer 0)


@needs_kernel
@pytest.mark.parametrize("block", [16, 100])  # 100: blocks longer than the exact pass's 64-row tile, not a multiple
def test_long_history_many_blocks_and_threads(block):
    """A few hundred positions over paged blocks, batch 4 x 3 groups on every thread torch has."""
    torch.manual_seed(0)
    cfg = dict(top_k=32, cache_size=8, window=16, recall=4, tau=0.5, refresh_every=3, gqa_policy="group",
               group_tau_min=0.2)
    trace = make_trace(B=4, H=9, H_kv=3, d=64, prompt_lens=(300, 200, 64, 33), steps=6, T=8)
    B, d = 4, 64
    methods = {name: make_method("retopk", backend=name, **cfg) for name in ("torch", "cpu")}
    state = methods["torch"].init_state(9, 3, d, capacity=B)
    slots = torch.tensor([state.alloc() for _ in range(B)])
    for b, P in enumerate(trace.prompt_lens):
        kv_b = PagedKV.contiguous(trace.keys[b:b + 1], trace.values[b:b + 1], torch.tensor([P]))
        methods["torch"].prefill(state, int(slots[b]), trace.prompt_queries[b], torch.arange(P - 8, P), kv_b)
    states = {"torch": state, "cpu": copy.deepcopy(state)}
    with torch.inference_mode():
        for t in range(6):
            kv = paged(trace.keys, trace.values, trace.lengths_at(t), block=block, seed=t)
            a, b = (methods[n].decode(trace.queries[t], kv, states[n], slots) for n in ("torch", "cpu"))
            assert_same_step(a, b, exported(states["torch"], slots), exported(states["cpu"], slots))


@needs_kernel
@pytest.mark.parametrize("B", [1, 4])
def test_head_policy_task_split_keeps_the_bits(B):
    """Under the "head" policy the kernel runs one task per head when there are fewer than two KV groups a thread
    (3 groups on 2 threads) and one task per group otherwise (1 thread; 12 groups on 2 threads), where a group's
    exact heads share one read of its keys. A head decides alone either way, so every output and the whole state
    are the same bits on 1 and 2 threads; the trace has steps where several heads of one group read exactly."""
    torch.manual_seed(0)
    cfg = dict(top_k=16, cache_size=8, window=8, recall=2, tau=0.8, refresh_every=3, gqa_policy="head",
               tau_calibration=0.8)
    trace = make_trace(B=B, H=9, H_kv=3, d=64, prompt_lens=(300, 120, 77, 40)[:B], steps=8, T=8)
    method = make_method("retopk", backend="cpu", **cfg)
    state = method.init_state(9, 3, 64, capacity=B)
    slots = torch.tensor([state.alloc() for _ in range(B)])
    for b, P in enumerate(trace.prompt_lens):
        kv_b = PagedKV.contiguous(trace.keys[b:b + 1], trace.values[b:b + 1], torch.tensor([P]))
        method.prefill(state, int(slots[b]), trace.prompt_queries[b], torch.arange(P - 8, P), kv_b)
    states = {1: state, 2: copy.deepcopy(state)}
    threads = torch.get_num_threads()
    shared_reads = 0  # (step, sequence, group)s with two or more exact heads
    try:
        with torch.inference_mode():
            for t in range(8):
                kv = paged(trace.keys, trace.values, trace.lengths_at(t), block=16, seed=t)
                outs = {}
                for n in (1, 2):
                    torch.set_num_threads(n)
                    outs[n] = method.decode(trace.queries[t], kv, states[n], slots)
                for field in ("out", "path", "max_sim", "n_scored", "selected"):
                    assert torch.equal(getattr(outs[1], field), getattr(outs[2], field)), (t, field)
                exact = (outs[1].path != Path.REUSE).view(B, 3, 3).sum(-1)  # (B, H_kv) exact heads a group
                shared_reads += int((exact >= 2).sum())
                for name in state.fields:
                    for s in slots:
                        assert torch.equal(states[1].read_slot(int(s))[name], states[2].read_slot(int(s))[name]), name
    finally:
        torch.set_num_threads(threads)
    assert shared_reads > 0


@needs_kernel
def test_launcher_checks_name_the_culprit(monkeypatch):
    method = make_method("retopk", backend="cpu", top_k=4, cache_size=2, window=2, recall=1)
    state = method.init_state(4, 2, 8, capacity=2)
    slots = torch.tensor([state.alloc(), state.alloc()])
    k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    kv = PagedKV.contiguous(k, v)
    q = torch.randn(2, 4, 8)
    run = launch.retopk_decode
    with pytest.raises(ValueError, match="k_pool must be float32"):
        run(method, q, PagedKV.contiguous(k.to(torch.int32), v.to(torch.int32)), state, slots, 0.3)
    with pytest.raises(ValueError, match="v_pool dtype"):
        run(method, q, PagedKV.contiguous(k, v.to(torch.bfloat16)), state, slots, 0.3)
    with pytest.raises(ValueError, match="head dim"):
        run(method, torch.randn(2, 4, 6), kv, state, slots, 0.3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        run(method, torch.randn(2, 3, 8), kv, state, slots, 0.3)
    with pytest.raises(ValueError, match=r"slots\[0\] and slots\[1\]"):
        run(method, q, kv, state, torch.tensor([slots[0], slots[0]]), 0.3)
    with pytest.raises(ValueError, match=r"block_table\[1, 0\]"):
        run(method, q, PagedKV(kv.k_pool, kv.v_pool, torch.tensor([[0], [7]]), kv.lengths), state, slots, 0.3)
    with pytest.raises(ValueError, match="lengths"):
        run(method, q, PagedKV(kv.k_pool, kv.v_pool, kv.block_table, torch.tensor([10, 11])), state, slots, 0.3)
    state.phase = torch.tensor([0, 1, 1, 1])  # heads 0 and 1 share KV group 0
    with pytest.raises(ValueError, match=r"state.phase\[1\]"):
        run(method, q, kv, state, slots, 0.3)
    state.phase = torch.zeros(4, dtype=torch.long)
    other = make_method("retopk", backend="cpu", top_k=5, cache_size=2, window=2, recall=1)
    with pytest.raises(ValueError, match="state.support"):
        run(other, q, kv, state, slots, 0.3)
    constants = launch.calibration_constants(method.config)
    for bad, match in ((constants[:6], "calibration must be"), (constants[:6] + [1.5, 0.05], "tau_guard's target")):
        monkeypatch.setattr(launch, "calibration_constants", lambda cfg, bad=bad: bad)
        with pytest.raises(ValueError, match=match):
            run(method, q, kv, state, slots, 0.3)


@pytest.fixture
def fresh_extension(monkeypatch):
    """Forget the loaded extension before and after the test (its monkeypatches undone first)."""
    launch.extension.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    launch.extension.cache_clear()


@pytest.mark.parametrize("how", ["missing", "stale"])
def test_unusable_extension_logs_once_and_runs_the_torch_code(fresh_extension, tmp_path, caplog, how):
    if how == "missing":
        fresh_extension.setattr(build, "LIBRARY", tmp_path / "nothing.so")
    else:
        fresh_extension.setattr(build, "build_key", lambda: "another source")
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=3)
    trace = make_trace(B=2, H=4, H_kv=2, prompt_lens=(30, 17), steps=4, T=6)
    with caplog.at_level(logging.WARNING, logger="retopk_core.cpu.launch"):
        for a, b, _, _ in twin_run(cfg, trace, 4, 2):
            assert torch.equal(a.selected, b.selected)  # the same torch code, so the same order too
            torch.testing.assert_close(b.out, a.out, atol=0, rtol=0)
    lines = [r for r in caplog.records if r.name == "retopk_core.cpu.launch"]
    assert len(lines) == 1 and "runs the torch code" in lines[0].getMessage()
    assert ("not built" if how == "missing" else "stale") in lines[0].getMessage()
    assert not launch.available()
