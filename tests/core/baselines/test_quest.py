"""Quest against a per-head loop written from its definition: page min/max bounds, Top pages in budget."""

from __future__ import annotations

import pytest
import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import make_method
from tests.core.baselines._harness import attend, check_against_reference, drive, make_run


def reference_pages(q: torch.Tensor, keys: torch.Tensor, P: int, K: int) -> tuple[list[int], list[float]]:
    """Positions attended by one head, and every page's bound, from keys (L, d) directly."""
    L = keys.shape[0]
    q = q.double()
    bounds = []
    for p in range(-(-L // P)):
        page = keys[p * P:min(L, p * P + P)].double()
        lo, hi = page.min(0).values, page.max(0).values
        bounds.append(float(torch.maximum(q * lo, q * hi).sum()))  # sum_i max(q_i m_i, q_i M_i)
    positions, used = [], 0
    for p in sorted(range(len(bounds)), key=lambda p: bounds[p], reverse=True):
        size = min(P, L - p * P)
        if used + size > K:  # the ranked prefix within the token budget
            break
        used += size
        positions += list(range(p * P, p * P + size))
    return sorted(positions), bounds


@pytest.mark.parametrize("P, K, H, H_kv, block", [
    (4, 12, 4, 4, None),  # budget = 3 full pages
    (4, 14, 6, 2, 3),  # budget not a page multiple; GQA 3; pool blocks unaligned with pages
    (5, 5, 6, 2, None),  # budget = one page
    (3, 10, 4, 4, 4),
])
def test_matches_reference_loop(P, K, H, H_kv, block):
    # prompts end mid-page and on a page boundary; 5 decode steps cross page boundaries
    run = make_run(H=H, H_kv=H_kv, prompt_lens=(29, 16, 3), steps=5, seed=4)

    def reference(b, g, L, q, keys, values):
        want, bounds = reference_pages(q, keys, P, K)
        return want, attend(q, keys, values, want, run.scale), len(bounds)  # one bound per page

    check_against_reference(make_method("quest", top_k=K, page_size=P), run, block, reference)


def test_page_bounds_track_appended_tokens():
    """After prefill and each decode step the state's min/max equal those of the pages' actual keys."""
    P = 4
    run = make_run(H=4, H_kv=2, prompt_lens=(10, 7), steps=5, seed=5)
    method = make_method("quest", top_k=8, page_size=P)
    for _, lengths, _q, _out, state, slots in drive(method, run, block=4):
        for b, L in enumerate(lengths.tolist()):
            assert int(state.n_tokens[slots[b]]) == L
            for g in range(2):
                for p in range(-(-L // P)):
                    page = run.keys[b, g, p * P:min(L, p * P + P)]
                    torch.testing.assert_close(state.kmin[slots[b], g, p], page.min(0).values)
                    torch.testing.assert_close(state.kmax[slots[b], g, p], page.max(0).values)


def test_a_reused_slot_starts_empty():
    method = make_method("quest", top_k=8, page_size=4)
    state = method.init_state(4, 2, 8)
    slot = state.alloc()
    k = torch.randn(1, 2, 10, 8)
    method.prefill(state, slot, None, None, PagedKV.contiguous(k, k, torch.tensor([10])))
    assert int(state.n_tokens[slot]) == 10
    state.free(slot)
    assert state.alloc() == slot
    assert int(state.n_tokens[slot]) == 0
    assert torch.isinf(state.kmin[slot]).all() and (state.kmin[slot] > 0).all() and (state.kmax[slot] < 0).all()


def test_page_size_must_fit_the_budget():
    with pytest.raises(ValueError, match="page_size"):
        make_method("quest", top_k=8, page_size=16)
