"""Compiled kernels at the benchmark's shapes (Qwen2.5-7B layer: 28 q heads, 4 KV heads, d = 128, bf16,
K = 512), against the torch reference. GPU only: the interpreter is far too slow for these sizes."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from retopk_core.kernels.workspace_cache import WORKSPACES
from retopk_core.kv import PagedKV
from retopk_core.methods.base import Path
from retopk_core.methods.exact import ExactTopK, ExactTopKConfig
from retopk_core.methods.full import FullAttention
from retopk_core.methods.retopk import ReTopK
from retopk_core.retopk_config import ReTopKConfig
from tests.core.kernels._helpers import assert_rows_by_position, assert_topk_support, paged_from_dense, ref_scores

pytestmark = pytest.mark.gpu


def _qwen_kv(lengths, block=None, seed=0):
    B, H_kv, d = len(lengths), 4, 128
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H_kv, max(lengths), d, generator=gen).bfloat16()
    v = torch.randn(B, H_kv, max(lengths), d, generator=gen).bfloat16()
    if block is None:
        return PagedKV.contiguous(k.cuda(), v.cuda(), torch.tensor(lengths).cuda()), k, v
    return paged_from_dense(k, v, lengths, block, seed), k, v


@pytest.mark.parametrize("lengths,block", [([32768], None), ([20000, 7000, 513], 16)])
def test_full_and_exact_at_qwen_shapes(lengths, block):
    kv, k, _ = _qwen_kv(lengths, block)
    q = torch.randn(len(lengths), 28, 128, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    a, b = FullAttention().decode(q, kv, None, None), FullAttention(backend="triton").decode(q, kv, None, None)
    torch.testing.assert_close(b.out.float(), a.out.float(), atol=2e-2, rtol=2e-2)
    exact = ExactTopKConfig(512)
    a, b = ExactTopK(exact).decode(q, kv, None, None), ExactTopK(exact, backend="triton").decode(q, kv, None, None)
    assert_topk_support(b.selected, ref_scores(q.float().cpu(), k, lengths, 1 / math.sqrt(128)), 512, tol=1e-2)
    same = (a.selected.sort(-1).values == b.selected.sort(-1).values).float().mean()
    assert same > 0.99, same  # bf16 products summed in another order may swap near-tied boundary keys
    torch.testing.assert_close(b.out.float(), a.out.float(), atol=3e-2, rtol=3e-2)


def test_retopk_at_qwen_shapes_mixed_paths():
    lengths = [16384, 9000]
    kv_all, _, _ = _qwen_kv([x + 4 for x in lengths], 64)
    B, H = 2, 28
    params = dict(top_k=512, cache_size=32, window=32, recall=4, tau=0.85, refresh_every=3)
    ref, tri = ReTopK(ReTopKConfig(**params)), ReTopK(ReTopKConfig(**params), backend="triton")
    st = ref.init_state(H, 4, 128, device="cuda", capacity=B)
    gen = torch.Generator().manual_seed(3)
    prompt_q = torch.randn(B, H, 32, 128, generator=gen).bfloat16().cuda()
    for b in range(B):
        st.alloc()
        one = PagedKV(kv_all.k_pool, kv_all.v_pool, kv_all.block_table[b:b + 1], torch.tensor([lengths[b]]).cuda())
        tri.prefill(st, b, prompt_q[b], torch.arange(lengths[b] - 32, lengths[b]).cuda(), one)  # rows by position
    sk = copy.deepcopy(st)
    near = (torch.arange(H) % 3 != 0).view(1, H, 1).cuda()
    lens = list(lengths)
    for _ in range(4):
        lens = [x + 1 for x in lens]
        kv = PagedKV(kv_all.k_pool, kv_all.v_pool, kv_all.block_table, torch.tensor(lens).cuda())
        fresh = torch.randn(B, H, 128, generator=gen).bfloat16().cuda()
        q = torch.where(near, prompt_q[:, :, -1] + (0.1 * fresh.float()).bfloat16(), fresh)
        a, b = ref.decode(q, kv, st, torch.arange(B).cuda()), tri.decode(q, kv, sk, torch.arange(B).cuda())
        assert torch.equal(a.path, b.path)
        same = (a.selected.sort(-1).values == b.selected.sort(-1).values).float().mean()
        assert same > 0.99, same
        torch.testing.assert_close(b.out.float(), a.out.float(), atol=3e-2, rtol=3e-2)
        merged = WORKSPACES.shared(q.device).get("cand_merged", (B, H), torch.int8)
        assert (merged[b.path == Path.REUSE] == 1).all(), merged  # sorted runs: merge stages only
        assert_rows_by_position(sk.support)
        st, sk = copy.deepcopy(sk), sk  # continue both from the triton state, so near-tie swaps do not compound
