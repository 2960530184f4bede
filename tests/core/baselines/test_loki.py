"""Loki against a per-head loop written from its definition: PCA (by SVD) of the prompt's keys per KV
head, approximate scores in the rank-r space, exact attention over the Top-K."""

from __future__ import annotations

import pytest
import torch

from retopk_core.methods import make_method
from tests.core.baselines._harness import attend, check_against_reference, drive, make_run


def low_rank_keys(B, H_kv, L, d, r, seed):
    """Keys with r dominant directions (std 3) over d - r weak ones (std 0.3), randomly rotated, so the
    rank-r principal subspace is well separated and any correct PCA finds the same one."""
    g = torch.Generator().manual_seed(seed)
    std = torch.tensor([3.0] * r + [0.3] * (d - r))
    rot, _ = torch.linalg.qr(torch.randn(B, H_kv, d, d, generator=g))
    return (torch.randn(B, H_kv, L, d, generator=g) * std) @ rot.transpose(-1, -2) + torch.randn(d, generator=g)


def reference_basis(prompt_keys: torch.Tensor, r: int) -> torch.Tensor:
    """Top-r right singular vectors of the centred prompt keys (L, d) -> (d, r) float64."""
    x = prompt_keys.double() - prompt_keys.double().mean(0)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    return vh[:r].T


def reference_head(q, keys, values, basis, K, scale):
    q = q.double()
    approx = (keys.double() @ basis) @ (basis.T @ q)  # (L,) scores of P_r^T k_j against P_r^T q
    keep = sorted(approx.topk(min(K, len(approx))).indices.tolist())
    return keep, attend(q, keys, values, keep, scale)


@pytest.mark.parametrize("rank, K, H, H_kv, block", [
    (4, 6, 4, 4, None),
    (4, 9, 6, 2, 4),  # GQA 3, paged
    (2, 5, 6, 2, None),
])
def test_matches_reference_loop(rank, K, H, H_kv, block):
    d, prompt_lens, steps = 16, (30, 18, 12), 4
    keys = low_rank_keys(len(prompt_lens), H_kv, max(prompt_lens) + steps, d, rank, seed=8)
    run = make_run(H=H, H_kv=H_kv, d=d, prompt_lens=prompt_lens, steps=steps, seed=8, keys=keys)
    bases = [[reference_basis(run.keys[b, g, :P], rank) for g in range(H_kv)] for b, P in enumerate(prompt_lens)]

    def reference(b, g, L, q, keys, values):
        return (*reference_head(q, keys, values, bases[b][g], K, run.scale), L)  # every key scored approximately

    check_against_reference(make_method("loki", top_k=K, rank=rank), run, block, reference)


def test_basis_comes_from_the_first_prefill_and_stays_fixed():
    d, r = 16, 4
    keys = low_rank_keys(2, 2, 77, d, r, seed=9)  # the second prompt outgrows the state's first 64 positions
    run = make_run(H=4, H_kv=2, d=d, prompt_lens=(20, 70), steps=7, seed=9, keys=keys)
    method = make_method("loki", top_k=6, rank=r)
    for _, lengths, _q, _out, state, slots in drive(method, run):
        for b, P in enumerate(run.prompt_lens):
            assert int(state.n_tokens[slots[b]]) == int(lengths[b])
            for g in range(2):
                want = reference_basis(run.keys[b, g, :P], r)
                got = state.basis[slots[b], g].double()
                torch.testing.assert_close(got @ got.T, want @ want.T, atol=1e-4, rtol=0)  # same subspace
                torch.testing.assert_close(state.proj[slots[b], g, :int(lengths[b])].double(),
                                           run.keys[b, g, :int(lengths[b])].double() @ got, atol=1e-4, rtol=1e-4)


def test_rank_at_least_head_dim_selects_like_exact_topk():
    run = make_run(H=4, H_kv=2, d=8, prompt_lens=(21, 9), steps=2, seed=10)
    loki = drive(make_method("loki", top_k=5, rank=64), run)
    exact = drive(make_method("exact_topk", top_k=5), run)
    for (*_, a, _, _), (*_, e, _, _) in zip(loki, exact, strict=True):
        assert torch.equal(a.selected.sort(-1).values, e.selected.sort(-1).values)
