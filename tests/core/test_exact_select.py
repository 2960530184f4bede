"""exact_select (equation 1 for the heads that need it) against a brute-force Top-K per head.

A batch of short histories takes one padded gather + matmul (``_exact_select_short``); long ones
(or one sequence) loop over (sequence, KV group). Both must select what scoring every key of the
head's own sequence and taking its K best selects, touch only the heads in ``need``, and never
read past a sequence's length.
"""

from __future__ import annotations

import pytest
import torch

import retopk_core.methods.sparse as sparse
from retopk_core.methods.sparse import exact_select
from tests.core._scenario import paged


def brute_force(q, keys, lengths, k, scale):
    """q (B, H, d), keys (B, H_kv, L_cap, d) -> the sorted position set of each head's Top-K."""
    B, H, _ = q.shape
    G = H // keys.shape[1]
    out = {}
    for b in range(B):
        L = int(lengths[b])
        for h in range(H):
            scores = (keys[b, h // G, :L].double() @ q[b, h].double()) * scale  # (L,)
            out[b, h] = sorted(scores.topk(min(k, L)).indices.tolist())
    return out


@pytest.mark.parametrize("short", [True, False], ids=["padded batch", "per-group loop"])
@pytest.mark.parametrize("need_kind", ["all", "mixed", "one sequence"])
def test_exact_select_matches_brute_force_and_leaves_other_heads(short, need_kind, monkeypatch):
    if not short:
        monkeypatch.setattr(sparse, "SHORT_BATCH_KEYS", 0)
    g = torch.Generator().manual_seed(3)
    B, H, H_kv, d, L_cap, k = 3, 6, 2, 16, 50, 8
    keys, values = torch.randn(B, H_kv, L_cap, d, generator=g), torch.randn(B, H_kv, L_cap, d, generator=g)
    keys[:, :, 45:] = float("nan")  # past every length: must never be read
    lengths = torch.tensor([45, 20, 5])  # the last one is shorter than k
    kv = paged(keys, values, lengths, block=8, seed=1)
    q = torch.randn(B, H, d, generator=g)
    need = {"all": torch.ones(B, H, dtype=torch.bool),
            "mixed": torch.rand(B, H, generator=g) < 0.5,
            "one sequence": torch.tensor([[False] * H, [True] * H, [False] * H])}[need_kind]
    need[0, 0] = need_kind != "one sequence"  # at least one head of sequence 0 when mixed
    before_pos = torch.full((B, H, k), 7, dtype=torch.long)  # what a reuse path would have written
    before_scores = torch.full((B, H, k), 1.5)
    sel_pos, sel_scores = exact_select(q, kv, k, 0.25, need=need, sel_pos=before_pos.clone(),
                                       sel_scores=before_scores.clone())
    want = brute_force(q, keys, lengths, k, 0.25)
    for b in range(B):
        for h in range(H):
            got = sel_pos[b, h]
            if need[b, h]:
                valid = got[got >= 0]
                assert sorted(valid.tolist()) == want[b, h], (b, h)
                assert (got[len(valid):] == -1).all() and torch.isfinite(sel_scores[b, h, :len(valid)]).all()
                assert (sel_scores[b, h, len(valid):] == float("-inf")).all()
                exact = (keys[b, h // (H // H_kv), valid] @ q[b, h]) * 0.25
                torch.testing.assert_close(sel_scores[b, h, :len(valid)], exact, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(got, before_pos[b, h]) and torch.equal(sel_scores[b, h], before_scores[b, h])
