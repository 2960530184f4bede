"""ReTopK's dense floor (``dense_below`` = L_min): full attention below L_min, exact supports into the FIFO,
the paper's sparse step from L_min on. Checked against SDPA and the per-head reference loop."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method
from tests.core._reference import FALLBACK, RefHead, group_paths
from tests.core._scenario import make_trace


@pytest.mark.parametrize("policy", ["head", "group"])
@pytest.mark.parametrize("H,H_kv", [(4, 4), (6, 2)])
def test_dense_below_floor_then_reference_above(H, H_kv, policy):
    K, C, W, R, floor = 8, 4, 4, 2, 30
    # above the floor; unseeded, crossing it after 6 dense steps (2 plain, then C that push); unseeded, never
    # crossing (plain until L_t + C >= 30, then pushing); seeded (26 + C >= 30: 3 dense steps could not refill
    # the FIFO), crossing it after 3 dense steps
    prompt_lens = (40, 23, 15, 26)
    B, d, steps = len(prompt_lens), 16, 12
    trace = make_trace(B=B, H=H, H_kv=H_kv, d=d, prompt_lens=prompt_lens, steps=steps, T=C + 2)
    scale, G = 1 / math.sqrt(d), H // H_kv
    method = make_method("retopk", top_k=K, cache_size=C, window=W, recall=R, tau=0.85, refresh_every=5,
                         gqa_policy=policy, dense_below=floor)
    state = method.init_state(H, H_kv, d, capacity=B)
    slots = torch.tensor([state.alloc() for _ in range(B)])
    refs = [[RefHead(C, K, W, R, 0.85, 5) for _ in range(H)] for _ in range(B)]
    for b, P in enumerate(prompt_lens):
        pos = torch.arange(P - C - 2, P).clamp(min=0)
        method.prefill(state, int(slots[b]), trace.prompt_queries[b], pos,
                       PagedKV.contiguous(trace.keys[b:b + 1], trace.values[b:b + 1], torch.tensor([P])))
        if P + C >= floor:  # the spec: seeding is skipped when C dense steps will refill the FIFO first
            for h in range(H):
                refs[b][h].prefill(trace.prompt_queries[b, h].double(), pos.tolist(), trace.keys[b, h // G].double(),
                                   scale)
    assert state.fill[slots].tolist() == [C, 0, 0, C]
    seen_dense = seen_sparse = seen_plain = 0
    full = make_method("full")
    for t in range(steps):
        lengths = trace.lengths_at(t)
        kv = PagedKV.contiguous(trace.keys, trace.values, lengths)
        q = trace.queries[t]
        fill_before = state.fill[slots].clone()
        out = method.decode(q, kv, state, slots)
        dense_out = full.decode(q, kv, full.init_state(H, H_kv, d, capacity=B), slots).out
        for b in range(B):
            L = int(lengths[b])
            keys, values = trace.keys[b, :, :L], trace.values[b, :, :L]
            if L + C < floor:  # plain dense: Full attention's own step, nothing selected or pushed
                seen_plain += 1
                assert (out.path[b] == Path.DENSE).all()
                torch.testing.assert_close(out.out[b], dense_out[b], atol=1e-6, rtol=1e-6)  # batched differently
                assert (out.selected[b] == -1).all()
                assert int(state.fill[slots[b]]) == int(fill_before[b])
                for ref in refs[b]:
                    ref.plain_step()
                continue
            if L < floor:  # dense: SDPA's output; the FIFO gets the exact support (a reference fallback step)
                seen_dense += 1
                assert (out.path[b] == Path.DENSE).all()
                want = torch.nn.functional.scaled_dot_product_attention(
                    q[b].unsqueeze(1), keys, values, enable_gqa=H != H_kv).squeeze(1)
                torch.testing.assert_close(out.out[b], want, atol=1e-5, rtol=1e-5)
                for h in range(H):
                    _, _, _, support, _ = refs[b][h].step(q[b, h], keys[h // G], values[h // G], scale, FALLBACK)
                    sel = out.selected[b, h]
                    assert sorted(sel[sel >= 0].tolist()) == sorted(support)
                continue
            seen_sparse += 1
            paths = [p for g in range(H_kv) for p in group_paths(refs[b][g * G:(g + 1) * G],
                                                                 list(q[b, g * G:(g + 1) * G]), policy)]
            for h in range(H):
                path, _, _, support, ref_out = refs[b][h].step(q[b, h], keys[h // G], values[h // G], scale, paths[h])
                assert int(out.path[b, h]) == path, (t, b, h)
                sel = out.selected[b, h]
                assert sorted(sel[sel >= 0].tolist()) == sorted(support)
                torch.testing.assert_close(out.out[b, h].double(), ref_out, atol=1e-4, rtol=1e-4)
    assert seen_dense and seen_sparse and seen_plain
    assert state.fill[slots].tolist() == [C, C, 2, C]  # row 2 pushed at L_t = 26, 27 only (floor - C = 26)


def test_floor_zero_is_the_paper():
    method = make_method("retopk", top_k=8, cache_size=4, window=4, recall=2)
    assert method.config.dense_below == 0
    with pytest.raises(ValueError, match="dense_below"):
        make_method("retopk", dense_below=-1)
