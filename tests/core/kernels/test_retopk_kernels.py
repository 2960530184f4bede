"""The ReTopK triton path (selector -> indexed QK -> exact kernels -> select + attend + FIFO) against
the torch reference of the core, step by step, with mixed paths inside every step."""

from __future__ import annotations

import copy

import pytest
import torch

from retopk_core.kernels.bitonic import next_pow2
from retopk_core.kv import PagedKV
from retopk_core.methods.base import Path
from retopk_core.methods.retopk import ReTopK, by_position
from retopk_core.retopk_config import ReTopKConfig
from tests.core.kernels._helpers import DEVICE, assert_rows_by_position, make_kv

CASES = [  # (H_kv, G, d, K, C, W, R, lengths, block, retrieval, prefill_rows)
    (1, 3, 64, 8, 8, 4, 2, [200, 90], 16, "similarity", (0, 1)),
    (2, 1, 128, 16, 4, 8, 4, [400, 60], None, "recent", (0,)),  # sequence 1: empty cache -> fallback
    (1, 7, 64, 4, 6, 3, 3, [64, 30], 8, "similarity", (0, 1)),
    (1, 2, 64, 8, 4, 8, 2, [5, 3], None, "similarity", (0, 1)),  # L < W, L < K
    (1, 3, 128, 512, 4, 32, 2, [1100, 700], 64, "similarity", (0, 1)),
]
STEPS = 4


def _run(H_kv, G, d, K, C, W, R, lengths, block, retrieval, prefill_rows, steps=STEPS, seed=0,
         policy=("head", 0.0, 0.8), layer=0, noise=0.15, edit=None, **extra):
    """Yield (torch StepOutput, triton StepOutput, torch state, triton state) for each decode step;
    ``extra``: further ReTopKConfig fields; the state is the method's layer-th (its refresh phases);
    ``noise``: how far the near heads' queries stray from their last prompt query; ``edit(state)``
    changes the prefilled state before both paths get a copy."""
    B, H = len(lengths), H_kv * G
    gen = torch.Generator().manual_seed(seed)
    cap = max(lengths) + steps
    kv_all, _, _ = make_kv(B, H_kv, cap, d, [cap] * B, torch.float32, block, seed=seed + 1)
    params = dict(top_k=K, cache_size=C, window=W, recall=R, tau=policy[2], refresh_every=3, retrieval=retrieval,
                  gqa_policy=policy[0], group_tau_min=policy[1], **extra)
    ref, tri = ReTopK(ReTopKConfig(**params)), ReTopK(ReTopKConfig(**params), backend="triton")
    for _ in range(layer):
        ref.init_state(H, H_kv, d, device=DEVICE)
    st = ref.init_state(H, H_kv, d, device=DEVICE, capacity=B)
    T = min(C, min(lengths))
    prompt_q = torch.randn(B, H, T, d, generator=gen).to(DEVICE)
    for b in range(B):
        assert st.alloc() == b
        if b in prefill_rows:
            one = PagedKV(kv_all.k_pool, kv_all.v_pool, kv_all.block_table[b:b + 1],
                          torch.tensor([lengths[b]], device=DEVICE))
            # the Triton method's prefill (rows by position), the state both paths start from
            tri.prefill(st, b, prompt_q[b], torch.arange(lengths[b] - T, lengths[b], device=DEVICE), one)
    st.step[1] = 1  # the two sequences reach the refresh step (t_dec = 3) at different decode steps
    if edit is not None:
        edit(st)
    sk = copy.deepcopy(st)
    slots = torch.arange(B, device=DEVICE)
    lens = list(lengths)
    # per head: a small perturbation of its last prompt query (reuse) or a fresh direction (fallback);
    # sequence 0 mixes both inside each KV group, the others keep every head near (whole groups reuse)
    near = ((torch.arange(H) % 2 == 0).view(1, H) | (torch.arange(B) > 0).view(B, 1)).unsqueeze(-1).to(DEVICE)
    for _ in range(steps):
        lens = [x + 1 for x in lens]
        kv = PagedKV(kv_all.k_pool, kv_all.v_pool, kv_all.block_table, torch.tensor(lens, device=DEVICE))
        fresh = torch.randn(B, H, d, generator=gen).to(DEVICE)
        q = torch.where(near, prompt_q[:, :, -1] + noise * fresh, fresh)
        pre_t, pre_k = copy.deepcopy(st), copy.deepcopy(sk)
        a = ref.decode(q, kv, st, slots)
        b = tri.decode(q, kv, sk, slots)
        yield a, b, st, sk, (q, kv, pre_t, pre_k, ref, tri)


# GQA policies (gqa_policy, group_tau_min, tau); "head" runs every case, the others the grouped ones.
# tau = 0.5 lets a group whose near heads outvote its fresh one reuse with a head below tau.
POLICIES = [("head", 0.0, 0.8), ("promote", 0.0, 0.8), ("group", 0.0, 0.8), ("group", 0.0, 0.5), ("group", 0.9, 0.8)]


# every case under the paper's policy; the GQA policies on the grouped cases (G > 1) except the K = 512 one,
# which is slow under the interpreter
CASE_POLICIES = [pytest.param(*case, policy, id=f"{i}-{policy[0]}-{policy[1]}-{policy[2]}")
                 for i, case in enumerate(CASES) for policy in POLICIES
                 if policy[0] == "head" or (case[1] > 1 and case[3] < 512)]


@pytest.mark.parametrize("H_kv,G,d,K,C,W,R,lengths,block,retrieval,prefill_rows,policy", CASE_POLICIES)
def test_retopk_triton_matches_torch_reference(H_kv, G, d, K, C, W, R, lengths, block, retrieval, prefill_rows,
                                               policy):
    seen = set()
    for a, b, st, sk, _ in _run(H_kv, G, d, K, C, W, R, lengths, block, retrieval, prefill_rows, policy=policy):
        _assert_same_step(a, b, st, sk)
        seen |= set(a.path.flatten().tolist())
    if lengths != [5, 3]:  # every path occurs within the few steps of the larger cases
        assert {Path.REUSE, Path.REFRESH} <= seen, seen
        if policy[0] == "head":
            assert Path.FALLBACK in seen, seen
        else:  # odd heads get fresh queries, even heads near ones: groups are read for part of their heads
            assert Path.PROMOTED in seen or policy[:2] == ("group", 0.0), seen


@pytest.mark.parametrize("policy,calibration", [(("head", 0.0, 0.8), 0.0), (("group", 0.0, 0.8), 0.8)],
                         ids=["head", "group-calibrated"])
def test_dense_floor_on_the_device_matches_torch(policy, calibration):
    """dense_below = 62 decided on the device, C = 4: the shortest row (L_t = 56..59) takes plain dense
    steps (full attention, nothing selected, no FIFO entry: L_t + C < 62) and then dense steps that push
    their exact Top-K, the middle one (61..64) a pushing dense step and then the sparse step after it crossed
    the floor, the long row the sparse step, as in the torch code. With tau_calibration (the group policy)
    the sparse rows' thresholds move as the torch path moves them (some of its heads below tau reuse with
    their group and keep theirs), the dense rows' do not."""
    seen, kinds, reused_below = set(), set(), False
    noise = 0.75 if calibration else 0.15  # calibrated: similarities near tau, so that exact heads move it
    for a, b, st, sk, (_, kv, pre_t, pre_k, *_r) in _run(1, 3, 64, 8, 4, 4, 2, [120, 60, 55], 16, "similarity",
                                                         (0, 1, 2), steps=4, policy=policy, noise=noise,
                                                         dense_below=62, tau_calibration=calibration):
        lengths = kv.lengths.tolist()
        dense = a.path == Path.DENSE
        assert torch.equal(b.max_sim.isnan(), dense)
        _assert_same_step(a, b, st, sk, skip_max_sim=dense)
        seen |= set(a.path.flatten().tolist())
        assert torch.equal(st.tau[dense], pre_t.tau[dense])
        reused_below |= bool(((a.max_sim < pre_t.tau) & (a.path == Path.REUSE)).any())
        for row, L in enumerate(lengths):
            if L + 4 < 62:  # plain: the FIFO as it was, only the step counter moved
                kinds.add("plain")
                assert (b.selected[row] == -1).all() and (b.path[row] == Path.DENSE).all()
                assert torch.equal(sk.queries[row], pre_k.queries[row]) and torch.equal(sk.support[row],
                                                                                          pre_k.support[row])
                assert (sk.fill[row], sk.ptr[row], sk.step[row]) == (pre_k.fill[row], pre_k.ptr[row],
                                                                      pre_k.step[row] + 1)
            else:
                kinds.add("push" if L < 62 else "sparse")
                assert sk.fill[row] == min(pre_k.fill[row] + 1, 4) and (b.selected[row, :, 0] >= 0).all()
    assert kinds == {"plain", "push", "sparse"} and Path.REUSE in seen, (kinds, seen)
    assert lengths[1] >= 62 and lengths[2] + 4 >= 62  # rows crossed the floor / the push limit during the run
    if calibration:
        assert (st.tau[0] < 0.8).any() and reused_below, st.tau


@pytest.mark.parametrize("mass", [False, True], ids=["support", "mass"])
@pytest.mark.parametrize("policy,calibration", [(("head", 0.0, 0.8), 0.0), (("promote", 0.0, 0.8), 0.8)],
                         ids=["head", "promote-calibrated"])
def test_refresh_guard_on_the_device_matches_torch(policy, calibration, mass):
    """refresh_guard in the kernels: the selector decides each head's refresh on its own period, select +
    attend moves the periods of the refresh heads that would have reused by the recall reuse would have had
    (``mass_recall``: the support's softmax weight it keeps); paths, supports, outputs, thresholds and periods
    equal the torch path's, and the periods moved."""
    periods = set()
    for a, b, st, sk, _ in _run(1, 3, 64, 8, 4, 4, 2, [40, 20], 16, "similarity", (0, 1), steps=8,
                                policy=policy, noise=0.75, tau_calibration=calibration, refresh_guard=0.8,
                                mass_recall=mass):
        _assert_same_step(a, b, st, sk)
        periods |= set(sk.period.flatten().tolist())
    assert len(periods) > 1, periods  # T_r = 3: from the floor 1 to 2 or 3


# (policy, tau_calibration, refresh_guard, mass_recall): the guard alone, under calibration (whose ceiling keeps a
# raised tau) and the group policy, and under the period guard with mass recall
GUARDED = [(("head", 0.0, 0.8), 0.0, 0.0, False), (("group", 0.0, 0.8), 0.8, 0.0, False),
           (("promote", 0.0, 0.8), 0.8, 0.8, True)]


@pytest.mark.parametrize("successors", [False, True], ids=["supports", "successors"])
@pytest.mark.parametrize("policy,calibration,refresh_guard,mass", GUARDED,
                         ids=["head", "group-calibrated", "promote-calibrated-period-mass"])
def test_tau_guard_on_the_device_matches_torch(policy, calibration, refresh_guard, mass, successors):
    """tau_guard in the kernels: select + attend raises the tau of an exact head that would have reused (ρ_max >= its
    tau) and whose would-be reuse recall misses r_t to ρ_max + margin, after calibration, whose ceiling is then that
    raised tau; paths, supports, outputs, thresholds and periods equal the torch path's, and some tau rose above
    tau0. With ``recall_successors`` the selector's A_t (the reuse candidates, and the would-be recall the rules
    measure) also holds each recalled p + 1: n_scored and the thresholds still equal the torch code's (the first
    step's reuse heads score more candidates with successors than without, so a selector without them fails)."""
    assert ReTopK(ReTopKConfig(tau_guard=0.9, recall_successors=successors), backend="triton").steps.name == "triton"
    raised = False
    for a, b, st, sk, _ in _run(1, 3, 64, 8, 4, 4, 2, [40, 20], 16, "similarity", (0, 1), steps=8, policy=policy,
                                noise=0.75, tau_calibration=calibration, refresh_guard=refresh_guard,
                                mass_recall=mass, tau_guard=0.9, recall_successors=successors):
        _assert_same_step(a, b, st, sk)
        raised |= bool((sk.tau > 0.8 + 1e-6).any())
    assert raised, sk.tau


def _assert_same_step(a, b, st, sk, skip_max_sim=None):
    """One step of the triton path (b, sk) equals the torch path's (a, st), thresholds included."""
    assert torch.equal(a.path, b.path), (a.path, b.path)
    keep = slice(None) if skip_max_sim is None else ~skip_max_sim
    torch.testing.assert_close(b.max_sim[keep], a.max_sim[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(a.n_scored, b.n_scored), (a.n_scored, b.n_scored)
    assert torch.equal(a.selected.sort(-1).values, b.selected.sort(-1).values)
    torch.testing.assert_close(b.out, a.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sk.queries, st.queries, atol=1e-6, rtol=1e-6)
    assert torch.equal(sk.support.sort(-1).values, st.support.sort(-1).values)
    assert_rows_by_position(sk.support)
    for name in ("fill", "ptr", "step"):
        assert torch.equal(getattr(sk, name), getattr(st, name)), name
    torch.testing.assert_close(sk.tau, st.tau, atol=1e-6, rtol=0)
    assert torch.equal(sk.period, st.period), (sk.period, st.period)


# (H_kv, G, policy): MHA and GQA under the paper's policy, GQA under "promote" ("group": the calibrated dense
# floor case below)
CALIBRATED = [(3, 1, "head"), (1, 3, "head"), (1, 3, "promote")]


@pytest.mark.parametrize("H_kv,G,policy", CALIBRATED, ids=lambda x: str(x))
def test_calibrated_tau_on_the_device_matches_torch(H_kv, G, policy):
    """tau_calibration in the kernels: the selector reads state.tau per head and builds every head's A_t,
    select + attend moves the thresholds of the exact heads (fallback, refresh, promoted) by the recall
    reuse would have had. Near heads stray to ρ ~ 0.8 = tau, so some fall back within the band and move
    their tau (both ways), some just above it are refreshed or promoted, and (group) some below it reuse
    with their group and keep theirs; paths, supports, outputs and state.tau equal the torch path's."""
    moved = set()
    for a, b, st, sk, (_, _, pre_t, *_r) in _run(H_kv, G, 64, 8, 4, 4, 2, [40, 20], 16, "similarity", (0, 1),
                                                steps=5, policy=(policy, 0.0, 0.8), noise=0.75, tau_calibration=0.8):
        _assert_same_step(a, b, st, sk)
        changed = st.tau != pre_t.tau  # (B, H): slots are 0..B-1
        assert not (changed & (a.path == Path.REUSE)).any()
        moved |= set(a.path[changed].tolist())
        if policy == "group":
            moved |= {"reused below tau"} if bool(((a.max_sim < pre_t.tau) & (a.path == Path.REUSE)).any()) else set()
    assert (st.tau < 0.8).any() and (st.tau <= 0.8).all(), st.tau
    assert Path.FALLBACK in moved and Path.REFRESH in moved, moved
    if policy == "promote":
        assert Path.PROMOTED in moved, moved
    if policy == "group":
        assert "reused below tau" in moved, moved


@pytest.mark.parametrize("layer", [0, 1])
def test_staggered_refresh_matches_torch(layer):
    """refresh_stagger: the selector reads each head's refresh phase; paths and results equal the torch
    code's, and some step refreshes one KV group of a sequence but not the other."""
    seen_split = False
    for a, b, st, sk, _ in _run(2, 2, 64, 8, 4, 4, 2, [200, 90], 16, "similarity", (0, 1), steps=6,
                                layer=layer, refresh_stagger=True):
        assert torch.equal(st.phase, sk.phase) and st.phase.unique().numel() == 2
        assert torch.equal(a.path, b.path), (a.path, b.path)
        refresh = a.path == Path.REFRESH  # (B, H)
        seen_split |= bool((refresh.any(-1) & ~refresh.all(-1)).any())
        torch.testing.assert_close(b.max_sim, a.max_sim, atol=1e-5, rtol=1e-5)
        assert torch.equal(a.n_scored, b.n_scored)
        assert torch.equal(a.selected.sort(-1).values, b.selected.sort(-1).values)
        torch.testing.assert_close(b.out, a.out, atol=1e-5, rtol=1e-5)
        assert torch.equal(sk.support.sort(-1).values, st.support.sort(-1).values)
        assert_rows_by_position(sk.support)
        assert torch.equal(sk.step, st.step)
    assert seen_split


def test_refresh_first_on_the_device_matches_torch():
    """refresh_first: the prefill sets t_dec = -N and the selector refreshes every head of a row while its t_dec < 0
    (row 0: its first 2 steps; row 1, moved on to t_dec = 1 after its prefill, reaches its scheduled refresh at
    t_dec = 3 instead); paths, supports, outputs and thresholds equal the torch code's."""
    refreshed = []
    for a, b, st, sk, _ in _run(1, 3, 64, 8, 8, 4, 2, [200, 90], 16, "similarity", (0, 1), steps=5,
                                refresh_first=2, tau_calibration=0.8, recall_successors=True):
        _assert_same_step(a, b, st, sk)
        refreshed.append((a.path == Path.REFRESH).all(-1).tolist())  # (B,) per step
    assert refreshed == [[True, False], [True, False], [False, True], [False, False], [False, False]], refreshed


def _score_order(state):
    """Supports by descending position (-1s still last): unsorted runs, as supports in score order are."""
    state.support[:] = state.support.sort(-1, descending=True).values


@pytest.mark.parametrize("order,K,successors", [("by position", 8, False), ("score order", 8, False),
                                                ("by position", 6, False), ("by position", 8, True),
                                                ("score order", 8, True)])
def test_selector_candidates_equal_torch_candidates(order, K, successors):
    """Stage 1 alone: the packed candidate rows written by the selector are the sorted unique union,
    from the merge stages alone when every recalled run is sorted (the prefill's and the kernel's rows;
    K a power of two), from the full sort when some run is not (a state with unsorted supports: every
    entry at the first step) or K is not a power of two; ``cand_merged`` says which ran. With
    ``recall_successors`` (2 R runs, R = 3: the successors' runs alternate the other way) the same, the
    successors of sorted runs being sorted runs."""
    from retopk_core.kernels.workspace_cache import WORKSPACES

    H_kv, G, d, C, W, R = 1, 3, 64, 8, 6, 3
    edit = _score_order if order == "score order" else None
    for step, (a, _b, _, _sk, (q, kv, pre_t, _, ref, _)) in enumerate(
            _run(H_kv, G, d, K, C, W, R, [150, 120], 16, "similarity", (0, 1), steps=2, edit=edit,
                 recall_successors=successors)):
        B, H = q.shape[:2]
        N_pad = next_pow2(R * K * (2 if successors else 1) + W, 16)
        ws = WORKSPACES.shared(q.device)
        cand, count = ws.get("cand", (B, H, N_pad), torch.int32), ws.get("cand_count", (B, H), torch.int32)
        merged = ws.get("cand_merged", (B, H), torch.int8).cpu()
        reuse_heads = (a.path == Path.REUSE).cpu()
        assert (merged[~reuse_heads] == -1).all()  # no candidates built
        if order == "by position" and K == 8:
            assert (merged[reuse_heads] == 1).all(), merged
        elif K == 6 or step == 0:  # later steps may recall only the entries the kernel wrote, sorted
            assert (merged[reuse_heads] == 0).all(), merged
        sim, _ = ref._similarity(q.float() / q.float().norm(dim=-1, keepdim=True), pre_t, torch.arange(B))
        reuse = (a.path == Path.REUSE).nonzero().tolist()
        assert reuse, "the scenario must have reuse heads"
        for bb, hh in reuse:
            want = ref._candidates(sim[bb, hh].unsqueeze(0), pre_t, torch.tensor([bb]), torch.tensor([hh]),
                                   kv.lengths[bb:bb + 1])[0]
            want = want[want >= 0]
            n = int(count[bb, hh])
            assert n == len(want)
            assert cand[bb, hh, :n].long().tolist() == want.tolist()
        for bb, hh in (a.path != Path.REUSE).nonzero().tolist():
            assert int(count[bb, hh]) == 0


def test_retopk_decode_allocates_no_scratch_after_first_step():
    from retopk_core.kernels.workspace_cache import WORKSPACES

    WORKSPACES.clear()
    counts = []
    for _ in _run(1, 3, 64, 8, 4, 4, 2, [100, 80], 16, "similarity", (0, 1), steps=3):
        counts.append(WORKSPACES.shared(DEVICE).allocations)
    assert counts[0] > 0 and counts[1:] == [counts[0]] * 2, counts


@pytest.mark.parametrize("successors", [False, True], ids=["supports", "successors"])
@pytest.mark.parametrize("order", ["as crafted", "by position"])
def test_selector_drops_window_duplicates_and_keeps_union_with_torch(order, successors):
    """A crafted FIFO: supports holding positions inside the window (dropped after the selector's sort,
    the window is appended in order), below it, repeated across entries, -1 padding, a stale position
    >= L (after the window), R*K = 24 not a power of two, a row with fewer than R entries, L < W. As
    crafted the rows are unsorted (full sort) except where the window covers every entry (L = 4: every
    entry maps to w0, a sorted run); by position every run is sorted (merge stages only), the stale
    position and the window's entries included. With ``recall_successors`` the successors of L - 1 (39 at
    L = 40; 11 and the stale 12 at L = 12; 3 at L = 4) lie past the history and are padding: at L = 4 the
    crafted run's successors are then no longer all w0 (unsorted: the full sort); by position they stay sorted."""
    from retopk_core.kernels.workspace_cache import WORKSPACES

    K, C, W, R, d, H = 8, 4, 6, 3, 16, 2
    params = dict(top_k=K, cache_size=C, window=W, recall=R, tau=0.5, refresh_every=0, recall_successors=successors)
    ref, tri = ReTopK(ReTopKConfig(**params)), ReTopK(ReTopKConfig(**params), backend="triton")
    lengths = [40, 12, 4]
    B = len(lengths)
    kv, _, _ = make_kv(B, 1, 40, d, lengths, torch.float32, 8, seed=4)
    st = ref.init_state(H, 1, d, device=DEVICE, capacity=B)
    gen = torch.Generator().manual_seed(5)
    for _ in range(B):
        st.alloc()
    st.queries[:] = torch.nn.functional.normalize(torch.randn(B, H, C, d, generator=gen), dim=-1).to(DEVICE)
    sup = torch.full((B, H, C, K), -1, dtype=torch.long)
    sup[0, :, 0] = torch.tensor([35, 5, 39, 33, 0, -1, -1, -1])  # 35, 39 in the window {34..39}
    sup[0, :, 1] = torch.tensor([5, 34, 12, 33, 20, 21, 22, 23])
    sup[0, :, 2] = torch.tensor([38, 37, 36, 2, 1, 3, 4, 6])
    sup[0, :, 3] = torch.tensor([7, 8, 9, 10, 11, 13, 14, 15])
    sup[1, :, 0] = torch.tensor([11, 10, 0, 6, 12, 5, -1, -1])  # window {6..11}; 12 >= L (stale)
    sup[1, :, 1] = torch.tensor([5, 4, 3, 9, 8, 1, 2, 0])
    sup[2, :, 0] = torch.tensor([3, 0, 2, 1, -1, -1, -1, -1])  # L = 4 < W: everything is window
    if order == "by position":
        sup = by_position(sup)
    st.support[:] = sup.to(DEVICE)
    st.fill[:] = torch.tensor([C, 2, 1], device=DEVICE)
    st.ptr[:] = torch.tensor([1, 2, 1], device=DEVICE)
    st.step[:] = 3
    sk = copy.deepcopy(st)
    q = 2 * st.queries[:, :, 0] + 0.1 * torch.randn(B, H, d, generator=gen).to(DEVICE)  # near entry 0: reuse
    slots = torch.arange(B, device=DEVICE)
    pre = copy.deepcopy(st)
    a, b = ref.decode(q, kv, st, slots), tri.decode(q, kv, sk, slots)
    assert (a.path == Path.REUSE).all(), a.path
    N_pad = next_pow2(R * K * (2 if successors else 1) + W, 16)
    ws = WORKSPACES.shared(q.device)
    cand, count = ws.get("cand", (B, H, N_pad), torch.int32), ws.get("cand_count", (B, H), torch.int32)
    sim, _ = ref._similarity(q.float() / q.float().norm(dim=-1, keepdim=True), pre, slots)
    for bb in range(B):
        for hh in range(H):
            want = ref._candidates(sim[bb, hh].unsqueeze(0), pre, slots[bb:bb + 1], torch.tensor([hh]),
                                   kv.lengths[bb:bb + 1])[0]
            want = want[want >= 0].tolist()
            assert int(count[bb, hh]) == len(want)
            assert cand[bb, hh, :len(want)].tolist() == want
    assert 12 in cand[1, 0, :int(count[1, 0])].tolist()  # the stale position was recalled
    merged = ws.get("cand_merged", (B, H), torch.int8).cpu()
    assert merged.tolist() == ([[1] * H] * B if order == "by position" else
                               [[0] * H, [0] * H, [0 if successors else 1] * H]), merged
    if successors:  # with successors, < L: 40 at L = 40, 12 (of 11) and 13 (of the stale 12) at L = 12 are not
        assert 40 not in cand[0, 0, :int(count[0, 0])].tolist() and 13 not in cand[1, 0, :int(count[1, 0])].tolist()
        assert 6 in cand[0, 0, :int(count[0, 0])].tolist()  # the successor of 5, no support's position
    written = sk.support[torch.arange(B), :, pre.ptr]  # (B, H, K): the entry each row's step wrote
    assert_rows_by_position(sk.support if order == "by position" else written)
    torch.testing.assert_close(b.max_sim, a.max_sim, atol=1e-5, rtol=1e-5)
    assert torch.equal(a.n_scored, b.n_scored)
    assert torch.equal(a.selected.sort(-1).values, b.selected.sort(-1).values)
    torch.testing.assert_close(b.out, a.out, atol=1e-5, rtol=1e-5)
    assert torch.equal(sk.support.sort(-1).values, st.support.sort(-1).values)
    for name in ("fill", "ptr", "step"):
        assert torch.equal(getattr(sk, name), getattr(st, name)), name
