"""End-to-end method equivalences through the model: Exact Top-K with K >= context equals Full; ReTopK with
tau = 1 (every step falls back or refreshes, both exact) equals Exact Top-K; path statistics on request."""

from __future__ import annotations

import torch
from runtime_helpers import greedy, prompt_ids, runner_for, tiny_model

from retopk_core.methods.base import Path
from retopk_server.runtime import MethodSpec

N_NEW = 20


def test_exact_topk_with_k_at_least_context_equals_full(arch):
    model = tiny_model(arch)
    prompt = prompt_ids(40, seed=5)
    full = runner_for(model, MethodSpec("full"))
    exact = runner_for(model, MethodSpec.of("exact_topk", top_k=40 + N_NEW))
    assert greedy(exact, exact.open_session(), prompt, N_NEW) == greedy(full, full.open_session(), prompt, N_NEW)


def test_retopk_tau_one_equals_exact_topk(arch):
    model = tiny_model(arch)
    prompt = prompt_ids(60, seed=6)
    k = 12  # well below the context, so Top-K really differs from full attention
    exact = runner_for(model, MethodSpec.of("exact_topk", top_k=k))
    retopk = runner_for(model, MethodSpec.of("retopk", top_k=k, cache_size=8, window=4, recall=2, tau=1.0,
                                             refresh_every=7))
    expected = greedy(exact, exact.open_session(), prompt, N_NEW)
    assert greedy(retopk, retopk.open_session(), prompt, N_NEW) == expected
    full = runner_for(model, MethodSpec("full"))
    assert greedy(full, full.open_session(), prompt, N_NEW) != expected  # K really matters here


def test_step_stats_report_each_sessions_paths():
    model = tiny_model("llama", layers=3)
    runner = runner_for(model)
    specs = [MethodSpec("full"), MethodSpec.of("exact_topk", top_k=8),
             MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, tau=1.0, refresh_every=2)]
    sessions = [runner.open_session(spec) for spec in specs]
    lengths = [20, 30, 25]
    for s, n in zip(sessions, lengths, strict=True):
        runner.prefill(s, prompt_ids(n, seed=n))
    _, none = runner.decode(sessions, [1, 2, 3])
    assert none is None
    _, stats = runner.decode(sessions, [4, 5, 6], with_stats=True)  # ReTopK's t_dec = 1: not a refresh step
    assert len(stats) == 3
    for st in stats:
        assert st.path.shape == (3, 4) and st.path.dtype == torch.int8
        assert st.max_sim.shape == (3, 4) and st.n_scored.shape == (3, 4) and st.attention_s >= 0.0
    assert (stats[0].path == Path.DENSE).all() and (stats[0].n_scored == lengths[0] + 2).all()
    assert (stats[1].path == Path.EXACT).all() and (stats[1].n_scored == lengths[1] + 2).all()
    assert (stats[2].path == Path.FALLBACK).all() and (stats[2].max_sim < 1.0).all()
    assert stats[2].counts() == {"fallback": 12}
    _, stats = runner.decode(sessions, [7, 8, 9], with_stats=True)  # t_dec = 2 = T_r: scheduled refresh
    assert (stats[2].path == Path.REFRESH).all()


def test_step_stats_group_read_marks_the_kv_groups_with_a_full_read():
    """group_read[l, g] is True iff a query head of KV group g (heads 2g, 2g + 1 here) took fallback, refresh,
    promoted, exact or dense, written out here by loops; under gqa_policy 'promote' a read group holds no
    reusing head (its would-be reusers are promoted), under the paper's per-head policy it may."""
    model = tiny_model("llama", layers=2)  # 4 query heads, 2 KV heads
    runner = runner_for(model)
    params = dict(top_k=8, cache_size=4, window=2, recall=2, tau=0.3, refresh_every=0)  # tau 0.3: a mix of paths
    specs = [MethodSpec.of("retopk", **params, gqa_policy="promote"), MethodSpec.of("retopk", **params)]
    sessions = [runner.open_session(spec) for spec in specs]
    toks = [int(runner.prefill(s, prompt_ids(40, seed=3)).argmax()) for s in sessions]
    read_codes = {Path.FALLBACK, Path.REFRESH, Path.PROMOTED, Path.EXACT, Path.DENSE}
    seen: set[int] = set()
    reads = 0
    for _ in range(8):
        logits, stats = runner.decode(sessions, toks, with_stats=True)
        toks = logits.argmax(-1).tolist()
        for policy, st in zip(("promote", "head"), stats, strict=True):
            assert st.num_kv_heads == 2 and st.group_read.shape == (2, 2) and st.group_read.dtype == torch.bool
            for layer in range(2):
                for g in range(2):
                    codes = [int(st.path[layer, h]) for h in (2 * g, 2 * g + 1)]
                    read = any(c in read_codes for c in codes)
                    assert bool(st.group_read[layer, g]) == read, (policy, layer, g, codes)
                    if policy == "promote" and read:
                        assert Path.REUSE not in codes
                    reads += read
            seen |= set(st.path.unique().tolist())
    assert Path.PROMOTED in seen and Path.REUSE in seen and Path.FALLBACK in seen
    assert 0 < reads < 8 * 2 * 2 * 2  # steps x sessions x layers x groups: some groups read, some not


def test_retopk_reuses_after_prefill_with_low_tau():
    """tau = 0 accepts any cached query of non-negative cosine; a reusing head scores at most R*K + W keys."""
    model = tiny_model("qwen2")
    runner = runner_for(model, MethodSpec.of("retopk", top_k=6, cache_size=4, window=3, recall=2, tau=0.0,
                                             refresh_every=0))
    s = runner.open_session()
    runner.prefill(s, prompt_ids(50, seed=9))
    _, stats = runner.decode([s], [3], with_stats=True)
    st = stats[0]
    reuse = st.path == Path.REUSE
    assert reuse.any()
    assert (st.n_scored[reuse] <= 2 * 6 + 3).all()
    assert ((st.path == Path.REUSE) | (st.path == Path.FALLBACK)).all()
