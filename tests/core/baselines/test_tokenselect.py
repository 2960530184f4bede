"""TokenSelect against a per-sequence loop written from its definition: per-head softmax, soft vote summed
over the layer's heads, initial + selected + local tokens, and the consecutive-query selection cache."""

from __future__ import annotations

import math

import pytest
import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method
from tests.core.baselines._harness import attend, drive, make_run, selected_set


class RefSequence:
    """One sequence's TokenSelect with plain lists."""

    def __init__(self, K: int, initial: int, local: int, threshold: float):
        self.I, self.W, self.N, self.thr = initial, local, K - initial - local, threshold
        self.prev, self.sel, self.mid_end = None, [], 0

    def step(self, qs, keys, values, scale):
        """qs (H, d); keys/values (H_kv, L, d). Returns (hit, cosine, attended positions, outputs (H, d))."""
        H, d = qs.shape
        G = H // keys.shape[0]
        L = keys.shape[1]
        mid_end = max(L - self.W, self.I)
        Q = qs.double().flatten()
        cos = float(Q @ self.prev / (Q.norm() * self.prev.norm())) if self.prev is not None else -math.inf
        hit = cos >= self.thr
        if hit:  # reuse, topped up with tokens that left the local window
            room = self.N - len(self.sel)
            self.sel = self.sel + list(range(self.mid_end, mid_end))[:room]
        else:
            vote = [0.0] * L
            for h in range(H):
                p = torch.softmax(keys[h // G].double() @ qs[h].double() * scale, dim=0)
                for j in range(L):
                    vote[j] += float(p[j])
            self.sel = sorted(range(self.I, mid_end), key=lambda j: vote[j], reverse=True)[:self.N]
        self.prev, self.mid_end = Q, mid_end
        attended = sorted(set(range(min(self.I, L))) | set(self.sel) | set(range(mid_end, L)))
        outs = torch.stack([attend(qs[h], keys[h // G], values[h // G], attended, scale) for h in range(H)])
        return hit, cos, attended, outs


def drifting_queries(steps, B, H, d, seed):
    """Fresh random queries at steps 0 and 3, small drifts of the previous query otherwise."""
    g = torch.Generator().manual_seed(seed)
    qs = [torch.randn(B, H, d, generator=g)]
    for t in range(1, steps):
        fresh = t % 3 == 0
        qs.append(torch.randn(B, H, d, generator=g) if fresh else qs[-1] + 0.05 * torch.randn(B, H, d, generator=g))
    return torch.stack(qs)


@pytest.mark.parametrize("K, initial, local, H, H_kv, block", [
    (12, 3, 4, 4, 4, None),
    (10, 2, 3, 6, 2, 4),  # GQA 3, paged
    (9, 0, 2, 6, 2, None),  # no initial tokens
])
def test_matches_reference_loop(K, initial, local, H, H_kv, block):
    steps, d, prompt_lens = 7, 16, (35, 14, 5)
    queries = drifting_queries(steps, len(prompt_lens), H, d, seed=11)
    run = make_run(H=H, H_kv=H_kv, d=d, prompt_lens=prompt_lens, steps=steps, seed=11, queries=queries)
    method = make_method("tokenselect", top_k=K, initial=initial, local=local, threshold=0.9)
    refs = [RefSequence(K, initial, local, 0.9) for _ in prompt_lens]
    seen = set()
    for _, lengths, q, out, _, _ in drive(method, run, block=block):
        ref_out = torch.empty(out.out.shape, dtype=torch.float64)
        for b, L in enumerate(lengths.tolist()):
            hit, cos, attended, ref_out[b] = refs[b].step(q[b], run.keys[b, :, :L], run.values[b, :, :L], run.scale)
            assert abs(cos - 0.9) > 1e-3  # the trace keeps clear of the threshold
            seen.add(hit)
            assert (out.path[b] == (Path.CACHED if hit else Path.APPROX)).all(), (b, cos)
            for h in range(H):
                assert selected_set(out.selected[b, h]) == attended, (b, h)
            assert (out.n_scored[b] == (len(attended) if hit else L)).all()
        torch.testing.assert_close(out.out.double(), ref_out, atol=1e-5, rtol=1e-5)
        assert (out.n_approx == 0).all()
    assert seen == {True, False}  # the trace exercised both the vote and the cache


def test_prefill_clears_the_selection_cache():
    method = make_method("tokenselect", top_k=8, initial=2, local=2)
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)
    q = torch.randn(1, 4, 8, generator=g)
    state = method.init_state(4, 2, 8)
    slots = torch.tensor([state.alloc()])
    paths = []
    for L, prefill in [(20, True), (21, False), (25, True), (26, False)]:
        kv = PagedKV.contiguous(k, v, torch.tensor([L]))
        if prefill:
            method.prefill(state, int(slots[0]), None, None, kv)
            continue
        paths.append(int(method.decode(q, kv, state, slots).path[0, 0]))
        paths.append(int(method.decode(q, PagedKV.contiguous(k, v, torch.tensor([L + 1])), state, slots).path[0, 0]))
    assert paths == [Path.APPROX, Path.CACHED, Path.APPROX, Path.CACHED]


def test_paper_split_is_64_initial_416_selected_32_local():
    d = make_method("tokenselect").describe()
    assert (d["initial"], d["selected"], d["local"], d["threshold"]) == (64, 416, 32, 0.9)
