"""ReTopK (batched torch core) against the per-head reference loop written from the paper."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method
from retopk_core.retopk_config import ReTopKConfig
from tests.core._reference import RefHead, group_paths, stagger_phase
from tests.core._scenario import make_trace, paged
from tests.core.kernels._helpers import assert_rows_by_position


def run_both(cfg: dict, trace, H, H_kv, use_paged=False, dtype=torch.float32, no_prefill=False, layer=0, keep=None,
             turns=()):
    """Drive core and reference through the same trace; yield per step (core output, reference rows).
    ``layer``: the state is the method's layer-th (the refresh phases under refresh_stagger depend on it).
    ``turns``: decode steps before which every sequence prefills again (a later turn's prompt: the prompt's
    queries pushed once more, over the keys of the sequence so far).
    ``keep``: a dict that receives the core's state, its slots and the reference heads.
    ``cfg`` may name the core's ``backend`` ("torch", "cpu": the fused CPU kernel)."""
    B = len(trace.prompt_lens)
    d = trace.keys.shape[-1]
    scale = 1 / math.sqrt(d)
    method = make_method("retopk", **cfg)
    for _ in range(layer):  # the states of the layers before
        method.init_state(H, H_kv, d)
    state = method.init_state(H, H_kv, d, capacity=1)  # grows while allocating B slots
    slots = torch.tensor([state.alloc() for _ in range(B)])
    G = H // H_kv
    T_r = cfg["refresh_every"]
    phase = [stagger_phase(layer, h // G, H_kv, T_r) if cfg.get("refresh_stagger") and T_r else 0 for h in range(H)]
    refs = [[RefHead(cfg["cache_size"], cfg["top_k"], cfg["window"], cfg["recall"], cfg["tau"],
                     T_r, cfg.get("retrieval", "similarity"), phase[h], cfg.get("tau_calibration", 0.0),
                     cfg.get("refresh_guard", 0.0), cfg.get("mass_recall", False), cfg.get("tau_guard", 0.0),
                     cfg.get("tau_guard_margin", 0.05), cfg.get("recall_successors", False),
                     cfg.get("refresh_first", 0))
             for h in range(H)] for _ in range(B)]
    if keep is not None:
        keep.update(state=state, slots=slots, refs=refs)
    keys, values = trace.keys.to(dtype), trace.values.to(dtype)

    def prefill(lengths):
        for b, P in enumerate(trace.prompt_lens):
            T = trace.prompt_queries.shape[2]
            pos = torch.arange(P - T, P).clamp(min=0)
            kv_b = PagedKV.contiguous(keys[b:b + 1], values[b:b + 1], lengths[b:b + 1])
            method.prefill(state, int(slots[b]), trace.prompt_queries[b].to(dtype), pos, kv_b)
            for h in range(H):
                refs[b][h].prefill(trace.prompt_queries[b, h].to(dtype).double(), pos.tolist(),
                                   keys[b, h // G].double(), scale)

    if not no_prefill:
        prefill(torch.tensor(trace.prompt_lens))
    for t in range(trace.queries.shape[0]):
        lengths = trace.lengths_at(t)
        if t in turns:
            prefill(lengths - 1)  # the keys before this step's token
        kv = paged(keys, values, lengths, block=8, seed=t) if use_paged else PagedKV.contiguous(keys, values, lengths)
        q = trace.queries[t].to(dtype)
        out = method.decode(q, kv, state, slots)
        rows = []
        for b in range(B):
            L = int(lengths[b])
            policy, tau_min = cfg.get("gqa_policy", "head"), cfg.get("group_tau_min", 0.0)
            paths = [p for g in range(H_kv)
                     for p in group_paths(refs[b][g * G:(g + 1) * G], list(q[b, g * G:(g + 1) * G]), policy, tau_min)]
            rows.append([refs[b][h].step(q[b, h], keys[b, h // G, :L], values[b, h // G, :L], scale, paths[h])
                         for h in range(H)])
        yield out, rows


CASES = [
    # (H, H_kv, d, K, C, W, R, T_r, prompt_lens)
    (4, 4, 16, 8, 4, 4, 2, 5, (40, 23, 9)),  # MHA, FIFO wrap-around, refresh, L < K for one row
    (6, 2, 16, 16, 4, 4, 2, 0, (50, 30, 12)),  # GQA 3, no refresh
    (7, 1, 32, 4, 3, 2, 3, 4, (20, 6, 33)),  # GQA 7, R = C
    (6, 3, 16, 64, 5, 8, 4, 6, (70, 40, 10)),  # K > L everywhere: supports hold every position
    (4, 2, 16, 8, 4, 0, 2, 7, (30, 25, 18)),  # no recent window (ablation)
    (4, 2, 16, 8, 4, 50, 2, 3, (30, 25, 18)),  # W > L
]


# (gqa_policy, group_tau_min): the paper's per-head rule and the two GQA policies
POLICIES = [("head", 0.0), ("promote", 0.0), ("group", 0.0), ("group", 0.3)]


def case_scenario(case, policy, **extra):
    """A CASES entry and a POLICIES entry -> (method config, trace of 12 decode steps)."""
    H, H_kv, d, K, C, W, R, T_r, prompt_lens = case
    cfg = dict(top_k=K, cache_size=C, window=W, recall=R, tau=0.85, refresh_every=T_r, gqa_policy=policy[0],
               group_tau_min=policy[1], **extra)
    return cfg, make_trace(B=len(prompt_lens), H=H, H_kv=H_kv, d=d, prompt_lens=prompt_lens, steps=12, T=C + 2)


def assert_step_matches_reference(out, rows) -> set:
    """One decode step's output against the reference rows (paths, max_sim, support sets, candidate
    counts on reuse, outputs) -> the paths seen."""
    seen = set()
    for b, row in enumerate(rows):
        for h, (path, max_sim, cand, support, ref_out) in enumerate(row):
            seen.add(path)
            assert int(out.path[b, h]) == path, (b, h)
            assert float(out.max_sim[b, h]) == pytest.approx(max_sim, abs=1e-5) or max_sim == -math.inf
            sel = out.selected[b, h]
            assert sorted(sel[sel >= 0].tolist()) == sorted(support)
            if path == Path.REUSE:
                assert int(out.n_scored[b, h]) == len(cand)
            torch.testing.assert_close(out.out[b, h].double(), ref_out, atol=1e-4, rtol=1e-4)
    return seen


def assert_case_exercised(seen: set, case, policy) -> None:
    """The trace of ``case`` took both decisions, its refreshes, and (GQA policies) promotions."""
    assert {Path.REUSE, Path.FALLBACK} <= seen
    if case[7]:  # T_r
        assert Path.REFRESH in seen
    if policy[0] != "head" and case[0] != case[1]:
        assert Path.PROMOTED in seen  # a group was read for some of its heads only


def every_case(test):
    """Parametrize ``test`` over CASES x POLICIES."""
    test = pytest.mark.parametrize("case", CASES)(test)
    return pytest.mark.parametrize("policy", POLICIES, ids=[f"{p}-{m}" for p, m in POLICIES])(test)


@pytest.mark.parametrize("use_paged", [False, True])
@every_case
def test_matches_reference_loop(case, policy, use_paged):
    cfg, trace = case_scenario(case, policy)
    seen = set()
    for out, rows in run_both(cfg, trace, case[0], case[1], use_paged):
        seen |= assert_step_matches_reference(out, rows)
    assert_case_exercised(seen, case, policy)


@pytest.mark.parametrize("policy", ["head", "group"])
@pytest.mark.parametrize("layer", [0, 3])
def test_staggered_refresh_matches_reference(layer, policy):
    """refresh_stagger: each KV group refreshes at its own phase of T_r (torch core vs the reference loop),
    so within a layer groups refresh on different steps."""
    H, H_kv = 6, 3
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=4, gqa_policy=policy,
               refresh_stagger=True)
    trace = make_trace(B=2, H=H, H_kv=H_kv, d=16, prompt_lens=(40, 23), steps=13, T=6)
    refresh_steps = {g: set() for g in range(H_kv)}
    for t, (out, rows) in enumerate(run_both(cfg, trace, H, H_kv, layer=layer)):
        for b, row in enumerate(rows):
            for h, (path, _max_sim, _, support, ref_out) in enumerate(row):
                assert int(out.path[b, h]) == path, (t, b, h)
                sel = out.selected[b, h]
                assert sorted(sel[sel >= 0].tolist()) == sorted(support)
                torch.testing.assert_close(out.out[b, h].double(), ref_out, atol=1e-4, rtol=1e-4)
                if path == Path.REFRESH and b == 0:
                    refresh_steps[h // (H // H_kv)].add(t)
    assert all(len(s) == 3 for s in refresh_steps.values()), refresh_steps  # t_dec 1..12, T_r = 4: same rate
    assert len({min(s) for s in refresh_steps.values()}) > 1, refresh_steps  # not all groups on one step


@pytest.mark.parametrize("mass", [False, True], ids=["support", "mass"])
@pytest.mark.parametrize("policy", [("head", 0.0), ("group", 0.0)], ids=["head", "group"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["mha", "gqa"])
def test_calibrated_tau_matches_reference(case, policy, mass):
    """tau_calibration: each head's tau moves on its exact steps by the would-be reuse recall (torch core vs
    the reference loop's scalar rule; ``mass_recall``: the support's softmax weight reuse keeps): paths,
    supports and outputs still agree step by step, and the thresholds really moved (both ways: the trace has
    hits near tau and misses)."""
    cfg, trace = case_scenario(case, policy, tau_calibration=0.8, mass_recall=mass)
    cfg["tau"] = 0.8
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=24,
                       T=case[4] + 2, noise=0.4)  # noisy clusters: similarities near tau, hits and misses
    seen, keep = set(), {}
    for out, rows in run_both(cfg, trace, case[0], case[1], keep=keep):
        seen |= assert_step_matches_reference(out, rows)
    assert {Path.REUSE, Path.FALLBACK} <= seen
    ref_tau = torch.tensor([[h.tau for h in heads] for heads in keep["refs"]], dtype=torch.float64)  # (B, H)
    core_tau = keep["state"].tau[keep["slots"]].double()
    torch.testing.assert_close(core_tau, ref_tau, atol=1e-5, rtol=0)
    assert (ref_tau < 0.8 - 1e-9).any() and (ref_tau <= 0.8).all(), ref_tau  # relaxed, never above tau0


@pytest.mark.parametrize("mass", [False, True], ids=["support", "mass"])
@pytest.mark.parametrize("calibration", [0.0, 0.8], ids=["fixed-tau", "calibrated"])
@pytest.mark.parametrize("policy", [("head", 0.0), ("promote", 0.0), ("group", 0.0)], ids=["head", "promote", "group"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["mha", "gqa"])
def test_refresh_guard_matches_reference(case, policy, calibration, mass):
    """refresh_guard: each head's refresh period moves on its scheduled refreshes by the would-be reuse
    recall (torch core vs the reference loop's scalar rule; ``mass_recall``: by the support's softmax weight
    reuse keeps), so heads of one group refresh on different steps; paths, supports, outputs and the periods
    agree step by step, and the periods moved both ways."""
    cfg, _ = case_scenario(case, policy, tau_calibration=calibration, refresh_guard=0.8, mass_recall=mass)
    cfg.update(tau=0.8, refresh_every=8)
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=40,
                       T=case[4] + 2, noise=0.4)
    seen, keep, periods = set(), {}, set()
    for out, rows in run_both(cfg, trace, case[0], case[1], keep=keep):
        seen |= assert_step_matches_reference(out, rows)
        ref_period = torch.tensor([[h.period for h in heads] for heads in keep["refs"]])  # (B, H)
        assert torch.equal(keep["state"].period[keep["slots"]], ref_period), (keep["state"].period, ref_period)
        periods |= set(ref_period.flatten().tolist())
    assert {Path.REUSE, Path.FALLBACK, Path.REFRESH} <= seen
    assert {8, 1} <= periods and len(periods) > 2, periods  # shortened to the floor, and back up


@pytest.mark.parametrize("refresh_guard", [0.0, 0.8], ids=["fixed-period", "period-guard"])
@pytest.mark.parametrize("calibration", [0.0, 0.8], ids=["fixed-tau", "calibrated"])
@pytest.mark.parametrize("policy", [("head", 0.0), ("promote", 0.0)], ids=["head", "promote"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["mha", "gqa"])
def test_tau_guard_matches_reference(case, policy, calibration, refresh_guard):
    """tau_guard: a head that would have reused, observed on an exact step (a refresh; a promotion), whose
    would-be reuse recall is under the target has its tau raised above its ρ_max (torch core vs the reference
    loop's scalar rule): paths, supports, outputs and the thresholds agree step by step, and some threshold rose
    above tau0 (the guard acted). The period-guard cases raise by a margin under calibration's band (0.02), the
    others by the default 0.05."""
    cfg, _ = case_scenario(case, policy, tau_calibration=calibration, refresh_guard=refresh_guard, tau_guard=0.9,
                           tau_guard_margin=0.02 if refresh_guard else 0.05)
    cfg.update(tau=0.8, refresh_every=4)
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=40,
                       T=case[4] + 2, noise=0.4)
    seen, keep, raised = set(), {}, False
    for out, rows in run_both(cfg, trace, case[0], case[1], keep=keep):
        seen |= assert_step_matches_reference(out, rows)
        ref_tau = torch.tensor([[h.tau for h in heads] for heads in keep["refs"]], dtype=torch.float64)  # (B, H)
        torch.testing.assert_close(keep["state"].tau[keep["slots"]].double(), ref_tau, atol=1e-5, rtol=0)
        raised |= bool((ref_tau > 0.8 + 1e-6).any())
    assert {Path.REUSE, Path.FALLBACK, Path.REFRESH} <= seen
    assert raised


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("calibration", [0.0, 0.8], ids=["fixed-tau", "calibrated"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["mha", "gqa"])
def test_recall_successors_match_reference(case, calibration, backend):
    """recall_successors: A_t also holds p + 1 for every position p of the recalled supports (the torch core, and
    the fused CPU kernel where it loads, vs the reference loop's sets): paths, candidate counts, supports, outputs
    and thresholds agree step by step, and the method runs its backend's own step."""
    from retopk_core.cpu import launch

    cfg, _ = case_scenario(case, ("head", 0.0), tau_calibration=calibration, recall_successors=True, backend=backend)
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=24,
                       T=case[4] + 2, noise=0.4)
    seen, keep = set(), {}
    for out, rows in run_both(cfg, trace, case[0], case[1], keep=keep):
        seen |= assert_step_matches_reference(out, rows)
    assert Path.REUSE in seen
    ref_tau = torch.tensor([[h.tau for h in heads] for heads in keep["refs"]], dtype=torch.float64)  # (B, H)
    torch.testing.assert_close(keep["state"].tau[keep["slots"]].double(), ref_tau, atol=1e-5, rtol=0)
    own = backend if backend == "torch" or launch.available() else "torch"
    assert make_method("retopk", top_k=8, recall_successors=True, backend=backend).steps.name == own


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1]], ids=["mha-refresh5", "gqa-no-refresh"])
def test_refresh_first_matches_reference(case, backend):
    """refresh_first = N: the first N decode steps after each prefill (the first turn's and a later one's) refresh
    every head, and the scheduled refreshes count from the onset's end (the torch core, and the fused CPU kernel
    where it loads, vs the reference loop's own onset counter): paths, supports, outputs and the calibrated and
    guarded thresholds agree step by step."""
    from retopk_core.cpu import launch

    N, turn = 3, 11
    cfg, _ = case_scenario(case, ("head", 0.0), tau_calibration=0.8, tau_guard=0.5, recall_successors=True,
                           refresh_first=N, backend=backend)
    trace = make_trace(B=len(case[8]), H=case[0], H_kv=case[1], d=case[2], prompt_lens=case[8], steps=24,
                       T=case[4] + 2, noise=0.4)
    keep, paths = {}, []
    for out, rows in run_both(cfg, trace, case[0], case[1], keep=keep, turns=(turn,)):
        assert_step_matches_reference(out, rows)
        paths.append(out.path)
    onset = set(range(N)) | set(range(turn, turn + N))

    def scheduled(t):  # t_dec counts from the onset's end: a refresh at t_dec > 0, a multiple of T_r
        start = turn + N if t >= turn else N
        return case[7] > 0 and t > start and (t - start) % case[7] == 0

    for t, path in enumerate(paths):
        assert bool((path == Path.REFRESH).all()) == (t in onset or scheduled(t)), t
    assert any(bool((p == Path.REUSE).any()) for p in paths)
    ref_tau = torch.tensor([[h.tau for h in heads] for heads in keep["refs"]], dtype=torch.float64)  # (B, H)
    torch.testing.assert_close(keep["state"].tau[keep["slots"]].double(), ref_tau, atol=1e-5, rtol=0)
    assert keep["state"].step[keep["slots"]].tolist() == [24 - turn - N] * len(case[8])  # from the onset's end
    own = backend if backend == "torch" or launch.available() else "torch"
    assert make_method("retopk", top_k=8, refresh_first=N, backend=backend).steps.name == own


def test_tau_guard_rule_and_backend():
    """guard_tau by hand: a miss raises tau to ρ + 0.05 (capped at 1, never lowered), a hit keeps it; calibration
    keeps a raised tau as its ceiling; a tau_guard method runs its backend's own step (the fused CPU kernel where
    it loads, as the same method without the guard does)."""
    from retopk_core.methods.retopk_policy import calibrate_tau, guard_tau

    tau = torch.tensor([0.8, 0.8, 0.99, 0.9])
    rho = torch.tensor([0.9, 0.9, 0.92, 0.98])
    recall = torch.tensor([0.5, 0.95, 0.1, 0.1])
    torch.testing.assert_close(guard_tau(tau, rho, recall, 0.9), torch.tensor([0.95, 0.8, 0.99, 1.0]))
    torch.testing.assert_close(guard_tau(tau, rho, recall, 0.9, margin=0.02), torch.tensor([0.92, 0.8, 0.99, 1.0]))
    # calibration from a raised tau 0.95 (tau0 0.85): a good observation lowers it, a bad one cannot raise it
    up = calibrate_tau(torch.tensor([0.95, 0.95]), torch.tensor([0.93, 0.93]), torch.tensor([1.0, 0.0]), 0.8, 0.85)
    torch.testing.assert_close(up, torch.tensor([0.93, 0.95]))
    for backend in ("cpu", "triton"):  # cpu: the torch steps only where the kernel is not built, guard or not
        steps = make_method("retopk", top_k=8, tau_guard=0.9, backend=backend).steps.name
        assert steps == make_method("retopk", top_k=8, backend=backend).steps.name
    assert make_method("retopk", top_k=8, tau_guard=0.9, backend="triton").steps.name == "triton"


def test_guard_period_rule():
    """The update itself on hand-made observations (T_r = 128, target 0.8: floor 16, lengthen at >= 0.9)."""
    from retopk_core.methods.retopk import guard_period

    period = torch.tensor([128, 128, 32, 16, 64, 64, 128, 32])
    recall = torch.tensor([0.70, 0.85, 0.50, 0.10, 0.95, 0.89, 1.00, 0.90])
    new = guard_period(period, recall, 0.8, 128)
    # stale: halve; in the margin: keep; stale at the floor: keep; fresh: double; fresh at T_r: keep
    torch.testing.assert_close(new, torch.tensor([64, 128, 16, 16, 128, 64, 128, 64]))


def guard_trace(stale: bool, steps: int = 64, L0: int = 200, d: int = 16, seed: int = 0):
    """One head whose consecutive queries are within 0.04 rad of each other, so with a full FIFO it never
    falls back (tau 0.85): stale or not, ρ_max ~ 1 on every step. Stale: the query turns steadily in a
    plane (0.04 rad a step) over keys of large norm, so the Top-K of the current query drifts away from
    the supports the last exact step anchored, and reuse, which only recombines those supports and the
    recent window, misses more the longer it runs; no threshold on ρ sees it. Stable: the query stays
    put and every new key scores below the support, so the exact support never changes.
    -> keys, values (1, 1, L0 + steps, d), prompt queries (1, 8, d), decode queries (steps, 1, 1, d)."""
    g = torch.Generator().manual_seed(seed)
    u, v = torch.linalg.qr(torch.randn(d, 2, generator=g))[0].T  # orthonormal (d,) each
    keys = torch.randn(1, 1, L0 + steps, d, generator=g) * 5.0
    if not stale:
        keys[0, 0, L0:] = -u  # new keys score -|u|^2: never in the support
    values = torch.randn(1, 1, L0 + steps, d, generator=g)
    angle = (0.04 if stale else 0.0) * torch.arange(-8, steps, dtype=torch.float32)  # (8 + steps,)
    q = torch.cos(angle).view(-1, 1) * u + torch.sin(angle).view(-1, 1) * v  # (8 + steps, d)
    return keys, values, q[:8].view(1, 8, d), q[8:].view(steps, 1, 1, d)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_guard_shortens_the_period_on_stale_supports_only(backend):
    """A constructed stale head (similar queries, drifting supports) keeps a short refresh period (it starts
    at the floor T_r / 8, and its refreshes halve it again whenever it has grown past what the drift allows),
    which raises what reuse recalls of Exact Top-K's support; a stable head earns T_r back within its first
    LEVELS = 3 refreshes and selects exactly what it selects without the guard (its extra refreshes find the
    support reuse finds)."""
    from retopk_core.cpu import launch
    from retopk_core.fidelity import support_recall

    if backend == "cpu" and not launch.available():
        pytest.skip("fused CPU kernel not built")
    L0, steps, T_r = 200, 64, 16
    result = {}
    for stale in (True, False):
        keys, values, prompt_q, queries = guard_trace(stale, steps, L0)
        for guard in (0.0, 0.8):
            method = make_method("retopk", backend=backend, top_k=8, cache_size=8, window=4, recall=2, tau=0.85,
                                 refresh_every=T_r, refresh_guard=guard)
            state = method.init_state(1, 1, keys.shape[-1])
            slot = torch.tensor([state.alloc()])
            method.prefill(state, 0, prompt_q, torch.arange(L0 - 8, L0),
                           PagedKV.contiguous(keys, values, torch.tensor([L0])))
            paths, recalls, sels, max_period = [], [], [], 0
            for t in range(steps):
                kv = PagedKV.contiguous(keys, values, torch.tensor([L0 + t + 1]))
                out = method.decode(queries[t], kv, state, slot)
                exact = make_method("exact_topk", top_k=8).decode(queries[t], kv, None, slot).selected
                paths.append(int(out.path[0, 0]))
                recalls.append(float(support_recall(out.selected, exact)))
                sels.append(sorted(out.selected[0, 0].tolist()))
                max_period = max(max_period, int(state.period[0, 0]))
            assert Path.FALLBACK not in paths  # every step would reuse: only refreshes re-anchor
            result[stale, guard] = (paths, sum(recalls) / steps, sels, max_period, int(state.period[0, 0]))
    stale_off, stale_on = result[True, 0.0], result[True, 0.8]
    assert stale_on[4] < T_r and stale_off[4] == T_r  # the stale head ends on a shorter period
    assert stale_on[0].count(Path.REFRESH) > 2 * stale_off[0].count(Path.REFRESH)
    assert stale_on[1] > stale_off[1] + 0.05, (stale_on[1], stale_off[1])  # and reuse recalls more of Exact Top-K
    stable_off, stable_on = result[False, 0.0], result[False, 0.8]
    assert stable_on[4] == T_r and stable_on[2] == stable_off[2] and stable_on[1] == 1.0
    extra = stable_on[0].count(Path.REFRESH) - stable_off[0].count(Path.REFRESH)
    assert 0 < extra <= 3, extra  # the refreshes at T_r / 8, T_r / 4, T_r / 2 (steps 2, 4, 8), then T_r


def test_calibrate_tau_rule():
    """The update itself on hand-made observations (tau0 = 0.85, target recall 0.9)."""
    from retopk_core.methods.retopk import calibrate_tau

    tau = torch.tensor([0.80, 0.80, 0.85, 0.80, 0.85, 0.51, 0.84])
    rho = torch.tensor([0.78, 0.78, 0.70, 0.83, 0.91, 0.50, 0.84])
    rec = torch.tensor([1.00, 0.50, 0.10, 0.80, 0.00, 1.00, 0.00])
    new = calibrate_tau(tau, rho, rec, 0.9, 0.85)
    # near below, a hit: down by 0.1 x 0.1; a miss: up by 0.1 x 0.4; far below: unchanged; near above, a miss: up
    # by 0.1 x 0.1; 0.06 above: not near; never below tau0 - 0.35 or above tau0 (the last: a miss at tau0)
    expected = torch.tensor([0.79, 0.84, 0.85, 0.81, 0.85, 0.50, 0.85])
    torch.testing.assert_close(new, expected)


def test_staggered_refresh_spreads_a_model_over_the_period():
    """30 layers x 3 KV groups, T_r = 128 (the embedded model, the paper's T_r): over 4 periods every
    (layer, group) refreshes 4 times, and no step refreshes more than one group; without the stagger,
    every group of every layer refreshes on the same 4 steps."""
    from retopk_core.methods.retopk import head_paths

    layers, H, H_kv, T_r = 30, 9, 3, 128
    steps = torch.arange(1, 4 * T_r + 1)  # (S,) t_dec of one sequence over 4 periods
    for stagger in (True, False):
        method = make_method("retopk", refresh_every=T_r, refresh_stagger=stagger)
        states = [method.init_state(H, H_kv, 8) for _ in range(layers)]
        refresh = torch.stack([head_paths(torch.ones(len(steps), H), steps, method.config, st.phase) == Path.REFRESH
                               for st in states])  # (layers, S, H)
        per_group = refresh[..., ::H // H_kv]  # (layers, S, H_kv): heads of a group agree
        assert torch.equal(refresh, per_group.repeat_interleave(H // H_kv, dim=-1))
        assert (per_group.sum(1) == 4).all()  # the same average rate 1 / T_r for every (layer, group)
        at_once = per_group.sum((0, 2))  # (S,) groups refreshing per step
        assert int(at_once.max()) == (1 if stagger else layers * H_kv)


def test_recent_retrieval_ablation_matches_reference():
    cfg = dict(top_k=8, cache_size=5, window=4, recall=2, tau=0.85, refresh_every=0, retrieval="recent")
    trace = make_trace(B=2, H=4, H_kv=2, prompt_lens=(30, 17), steps=10, T=7)
    for out, rows in run_both(cfg, trace, 4, 2):
        for b, row in enumerate(rows):
            for h, (path, _, _, support, ref_out) in enumerate(row):
                assert int(out.path[b, h]) == path
                sel = out.selected[b, h]
                assert sorted(sel[sel >= 0].tolist()) == sorted(support)
                torch.testing.assert_close(out.out[b, h].double(), ref_out, atol=1e-4, rtol=1e-4)


def test_empty_cache_falls_back_then_reuses():
    cfg = dict(top_k=8, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=0)
    trace = make_trace(B=2, H=4, H_kv=2, prompt_lens=(30, 17), steps=6, outlier_p=0.0)
    paths = []
    for out, rows in run_both(cfg, trace, 4, 2, no_prefill=True):
        assert out.path.tolist() == [[r[0] for r in row] for row in rows]
        paths.append(out.path)
    assert (paths[0] == Path.FALLBACK).all()  # nothing cached yet: max_sim = -inf
    assert (torch.stack(paths[1:]) == Path.REUSE).any()


def test_tau_one_equals_exact_topk_every_step():
    trace = make_trace(B=3, H=6, H_kv=2, prompt_lens=(60, 41, 25), steps=10, noise=0.05, outlier_p=0.0)
    method = make_method("retopk", top_k=8, cache_size=4, window=4, recall=2, tau=1.0, refresh_every=0)
    exact = make_method("exact_topk", top_k=8)
    state = method.init_state(6, 2, 16, capacity=3)
    slots = torch.tensor([state.alloc() for _ in range(3)])
    for b, P in enumerate(trace.prompt_lens):
        kv_b = PagedKV.contiguous(trace.keys[b:b + 1], trace.values[b:b + 1], torch.tensor([P]))
        method.prefill(state, int(slots[b]), trace.prompt_queries[b], torch.arange(P - 6, P), kv_b)
    for t in range(10):
        kv = PagedKV.contiguous(trace.keys, trace.values, trace.lengths_at(t))
        got = method.decode(trace.queries[t], kv, state, slots)
        want = exact.decode(trace.queries[t], kv, None, None)
        assert (got.path == Path.FALLBACK).all()
        assert torch.equal(got.selected.sort(-1).values, want.selected.sort(-1).values)
        torch.testing.assert_close(got.out, want.out)


@pytest.mark.parametrize("H,H_kv", [(4, 4), (6, 2), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_topk_with_k_ge_length_equals_sdpa(H, H_kv, dtype):
    torch.manual_seed(0)
    B, d, L_cap = 3, 32, 50
    k, v = torch.randn(B, H_kv, L_cap, d, dtype=dtype), torch.randn(B, H_kv, L_cap, d, dtype=dtype)
    lengths = torch.tensor([50, 31, 1])
    q = torch.randn(B, H, d, dtype=dtype)
    kv = PagedKV.contiguous(k, v, lengths)
    for name, params in [("exact_topk", {"top_k": 64}), ("full", {})]:
        out = make_method(name, **params).decode(q, kv, None, None).out
        for b in range(B):
            L = int(lengths[b])
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[b].float().unsqueeze(1), k[b, :, :L].float(), v[b, :, :L].float(), enable_gqa=True).squeeze(1)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[b].float(), ref, atol=tol, rtol=tol)


def test_bfloat16_tracks_float32_reference():
    cfg = dict(top_k=16, cache_size=4, window=4, recall=2, tau=0.85, refresh_every=0)
    trace = make_trace(B=2, H=4, H_kv=2, d=32, prompt_lens=(40, 20), steps=5)
    for out, rows in run_both(cfg, trace, 4, 2, dtype=torch.bfloat16):
        assert out.out.dtype == torch.bfloat16
        for b, row in enumerate(rows):
            for h, r in enumerate(row):
                torch.testing.assert_close(out.out[b, h].double(), r[4], atol=3e-2, rtol=3e-2)


def test_state_pool_grows_and_keeps_contents():
    """Growing keeps what the slots in use export (``read_slot``; a run with a free slot between them too), and a
    new slot is handed out as a new pool's slot (its FIFO rows are never read while fill is 0)."""
    method = make_method("retopk", top_k=4, cache_size=2, window=2, recall=1)
    new = method.init_state(2, 1, 8, capacity=1)
    state = method.init_state(2, 1, 8, capacity=1)
    a = state.alloc()
    state.queries[a], state.support[a], state.fill[a] = 1.0, 3, 2  # a full FIFO
    b, c = state.alloc(), state.alloc()  # forces two doublings
    assert state.capacity >= 3 and len({a, b, c}) == 3
    assert (state.queries[a] == 1.0).all() and (state.support[a] == 3).all()
    for name, t in state.read_slot(b).items():
        assert torch.equal(t, new.read_slot(0)[name]), name
    state.queries[c], state.support[c], state.step[c], state.fill[c], state.ptr[c] = 2.0, 5, 9, 1, 1  # one row
    state.free(b)  # slots a and c in use, b free between them
    before = {s: state.read_slot(s) for s in (a, c)}
    assert (before[c]["queries"][:, 1:] == 0).all() and (before[c]["support"][:, 0] == 5).all()
    generation = state.generation
    grown = state.prepare_grow(2 * state.capacity)
    assert state.generation == generation and grown["queries"].shape[0] == 2 * state.capacity  # nothing changed yet
    state.commit_grow(2 * state.capacity, grown)
    assert state.generation > generation and state.free_slots == state.capacity - 2
    for s in (a, c):
        for name, t in state.read_slot(s).items():
            assert torch.equal(t, before[s][name]), (s, name)
    with pytest.raises(ValueError):
        state.free(b)


def test_a_reused_slot_is_reset_to_a_new_pools_slot():
    """A slot freed with every field written (calibrated tau, moved period, FIFO entries) and allocated again holds
    a new pool's counters and thresholds, and exports (``read_slot``) what slot 0 of a pool just made exports, field
    by field; ``fresh=False`` leaves it as it was."""
    method = make_method("retopk", top_k=4, cache_size=3, window=2, recall=1, tau=0.8, refresh_every=6,
                         refresh_guard=0.5)
    new = method.init_state(3, 1, 8, capacity=1)
    state = method.init_state(3, 1, 8, capacity=2)
    slot = state.alloc()
    for name in state.field_names():
        getattr(state, name)[slot] = 7
    state.free(slot)
    assert state.alloc(fresh=False) == slot and all((getattr(state, n)[slot] == 7).all() for n in state.field_names())
    state.free(slot)
    assert state.alloc() == slot
    for name in ("fill", "ptr", "step", "tau", "period"):
        assert torch.equal(getattr(state, name)[slot], getattr(new, name)[0]), name
    for name, t in state.read_slot(slot).items():
        assert torch.equal(t, new.read_slot(0)[name]), name


def test_a_new_tenants_export_holds_nothing_of_the_last():
    """Tenant A fills a slot's FIFO (a long prompt, then decode steps past its wrap-around) and frees it; tenant B
    gets the same slot with a short prompt (its FIFO not full). B's ``read_slot`` equals that of the same sequence
    in a never-used pool, bit for bit, and none of A's rows appears in it: the rows past B's fill are a new pool's
    (queries 0, support -1)."""
    C, T = 8, 3
    method = make_method("retopk", top_k=4, cache_size=C, window=2, recall=2, tau=0.5, refresh_every=0)
    trace = make_trace(B=2, H=4, H_kv=2, prompt_lens=(40, 12), steps=10, T=C)
    kv = [PagedKV.contiguous(trace.keys[b:b + 1], trace.values[b:b + 1], torch.tensor([P]))
          for b, P in enumerate(trace.prompt_lens)]
    state, never_used = method.init_state(4, 2, 16), method.init_state(4, 2, 16)
    a = state.alloc()
    method.prefill(state, a, trace.prompt_queries[0], torch.arange(40 - C, 40), kv[0])
    for t in range(10):
        kv_t = PagedKV.contiguous(trace.keys[:1], trace.values[:1], trace.lengths_at(t)[:1])
        method.decode(trace.queries[t, :1], kv_t, state, torch.tensor([a]))
    left = state.read_slot(a)
    assert int(left["fill"]) == C and (left["support"] >= 0).all()
    state.free(a)
    assert state.alloc() == a
    exports = []
    for pool, slot in ((state, a), (never_used, never_used.alloc())):
        method.prefill(pool, slot, trace.prompt_queries[1, :, -T:], torch.arange(12 - T, 12), kv[1])
        kv_t = PagedKV.contiguous(trace.keys[1:], trace.values[1:], trace.lengths_at(0)[1:])
        method.decode(trace.queries[0, 1:], kv_t, pool, torch.tensor([slot]))
        exports.append(pool.read_slot(slot))
    b, want = exports
    assert int(b["fill"]) == T + 1 < C
    for name, t in b.items():
        assert torch.equal(t, want[name]), name
    assert (b["queries"][:, T + 1:] == 0).all() and (b["support"][:, T + 1:] == -1).all()
    assert not (b["queries"].unsqueeze(2) == left["queries"].unsqueeze(1)).all(-1).any()  # no row of A's
    assert (state.queries[a, :, T + 1:] == left["queries"][:, T + 1:]).all()  # A's rows are still in the pool


def test_state_pool_grown_in_inference_mode_allocates_outside_it():
    method = make_method("retopk", top_k=4, cache_size=2, window=2, recall=1)
    with torch.inference_mode():
        state = method.init_state(2, 1, 8, capacity=1)
        state.alloc()
        state.free(state.alloc())  # grows: the pool's tensors are inference tensors now; one slot free
    slot = state.alloc()  # outside inference mode, as a server opening a session between steps
    assert int(state.fill[slot]) == 0 and (state.read_slot(slot)["support"] == -1).all()


@pytest.mark.parametrize("field,value", [("top_k", 0), ("cache_size", -1), ("recall", 40), ("tau", 1.5),
                                         ("window", -1), ("refresh_every", -2), ("retrieval", "random")])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "recall" else "recall"):
        ReTopKConfig(**{field: value})


def test_unknown_method_and_bad_parameter():
    with pytest.raises(ValueError, match="unknown method"):
        make_method("nope")
    with pytest.raises(ValueError, match="top_k"):
        make_method("retopk", top_k=0)
    with pytest.raises(ValueError, match="bad parameters"):
        make_method("exact_topk", tau=0.5)


def test_long_prompt_seeding_group_by_group_matches_reference(monkeypatch):
    """Prefill scores long prompts one KV group at a time (memory bound); force that branch on a small case."""
    import retopk_core.methods.retopk as retopk_module

    monkeypatch.setattr(retopk_module, "SHORT_BATCH_KEYS", 0)
    test_matches_reference_loop(CASES[1], POLICIES[0], use_paged=True)


@pytest.mark.parametrize("length", [12, 16, 40])  # K = 16: fewer keys than K, exactly K, more (three branches)
@pytest.mark.parametrize("short", [True, False])  # every group in one matmul, or one group at a time
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_fifo_holds_exact_causal_supports(length, short, backend, monkeypatch):
    """After prefill the FIFO holds each prompt query with its exact causal Top-K (equation 5): the
    query at position p never names a key after p, whatever the branch. The Triton method's rows are
    by position, -1s last (its selector's merge-only path; the prefill is torch code either way)."""
    import retopk_core.methods.retopk as retopk_module

    if not short:
        monkeypatch.setattr(retopk_module, "SHORT_BATCH_KEYS", 0)
    H, H_kv, d, K, C = 6, 2, 16, 16, 8
    trace = make_trace(B=1, H=H, H_kv=H_kv, d=d, prompt_lens=(length,), steps=1, T=C)
    method = make_method("retopk", top_k=K, cache_size=C, window=4, recall=2, backend=backend)
    state = method.init_state(H, H_kv, d, capacity=1)
    slot = state.alloc()
    pos = torch.arange(length - C, length).clamp(min=0)
    kv = PagedKV.contiguous(trace.keys, trace.values, torch.tensor([length]))
    method.prefill(state, slot, trace.prompt_queries[0], pos, kv)
    for h in range(H):
        ref = RefHead(C, K, 4, 2, 0.85, 0)
        ref.prefill(trace.prompt_queries[0, h].double(), pos.tolist(), trace.keys[0, h // (H // H_kv)].double(),
                    1 / math.sqrt(d))
        got = [sorted(s[s >= 0].tolist()) for s in state.support[slot, h]]
        assert got == [sorted(sup) for _, sup in ref.fifo], h
    if backend == "triton":
        assert_rows_by_position(state.support)


@pytest.mark.parametrize("name,params,field", [("retopk", {"top_k": 0}, "top_k"), ("retopk", {"recall": 40}, "recall"),
                                               ("exact_topk", {"tau": 0.5}, "tau"), ("nope", {}, "name"),
                                               ("quest", {"top_k": 8, "page_size": 16}, "page_size"),
                                               ("retopk", {"backend": "cuda"}, "backend")])
def test_bad_parameters_carry_their_field_as_data(name, params, field):
    from retopk_core.params import ParamError

    with pytest.raises(ParamError) as info:
        make_method(name, **params)
    assert info.value.field == field


def test_describe_lists_the_config_fields():
    method = make_method("retopk", top_k=8)
    assert method.describe() == {"method": "retopk", **ReTopKConfig(top_k=8).as_dict(), "backend": "torch"}
    assert ReTopKConfig() == ReTopKConfig(top_k=512, cache_size=32, window=32, recall=4, tau=0.85, refresh_every=128)


@pytest.mark.parametrize("name", ["full", "exact_topk", "retopk"])
def test_describe_names_the_backend_its_steps_run_on(name, monkeypatch):
    """describe() reads the step object chosen at construction, not the launcher at describe time: a "cpu" method
    built where the fused kernel did not load runs (and says it runs) the torch steps, whatever loads later."""
    from retopk_core.cpu import launch
    from retopk_core.methods import backend_steps

    monkeypatch.setattr(launch, "available", lambda: False)
    fallback = make_method(name, backend="cpu")
    assert type(fallback.steps) is backend_steps.TorchSteps
    monkeypatch.setattr(launch, "available", lambda: True)
    assert fallback.describe()["backend"] == "torch (cpu kernel not built)"
    fused = make_method(name, backend="cpu")
    monkeypatch.setattr(launch, "available", lambda: False)
    assert fused.describe()["backend"] == "cpu" and make_method(name).describe()["backend"] == "torch"
