"""Reading a sequence's whole history out of a block pool: in place when its blocks are consecutive.

The runtime's allocator hands out consecutive block ids, and the dense and exact paths then score
the pool in place, block by block (``PagedKV.blocks``); shuffled blocks are gathered. Both must
give what a contiguous cache gives, and never read the garbage past L in the last block.
"""

from __future__ import annotations

import pytest
import torch

from retopk_core.kv import PagedKV
from retopk_core.methods import make_method
from retopk_core.methods.retopk import _unique_rows


def _pool(keys: torch.Tensor, values: torch.Tensor, block: int, order: torch.Tensor, poison: bool) -> PagedKV:
    """keys/values (1, H_kv, L, d) cut into blocks of ``block`` stored at physical ids ``order``."""
    _, H_kv, L, d = keys.shape
    nb = -(-L // block)
    fill = float("nan") if poison else 0.0
    k = torch.full((nb * block, H_kv, d), fill)
    v = torch.full((nb * block, H_kv, d), fill)
    k[:L], v[:L] = keys[0].transpose(0, 1), values[0].transpose(0, 1)
    k_pool = torch.full((nb + 2, H_kv, block, d), fill)  # two spare blocks: ids need not start at 0
    v_pool = torch.full((nb + 2, H_kv, block, d), fill)
    k_pool[order] = k.view(nb, block, H_kv, d).transpose(1, 2)
    v_pool[order] = v.view(nb, block, H_kv, d).transpose(1, 2)
    return PagedKV(k_pool, v_pool, order.view(1, nb), torch.tensor([L]))


ORDERS = {"consecutive": [1, 2, 3, 4, 5], "two runs": [4, 5, 6, 0, 1], "shuffled": [4, 1, 5, 2, 3]}


@pytest.mark.parametrize("layout", list(ORDERS))
def test_blocks_equal_history_and_are_views_when_consecutive(layout):
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, 37, 8, generator=g), torch.randn(1, 2, 37, 8, generator=g)
    order = torch.tensor(ORDERS[layout])
    kv = _pool(keys, values, 8, order, poison=False)
    blocks, value_blocks = kv.blocks(kv.k_pool, 0), kv.blocks(kv.v_pool, 0)  # (5, 2, 8, 8)
    assert blocks.shape == value_blocks.shape == (5, 2, 8, 8)
    for head in range(2):
        assert torch.equal(blocks[:, head].reshape(40, 8)[:37], keys[0, head])
        assert torch.equal(value_blocks[:, head].reshape(40, 8)[:37], values[0, head])
        assert torch.equal(kv.keys(0, head), keys[0, head]) and torch.equal(kv.values(0, head), values[0, head])
    shares_pool = blocks.untyped_storage().data_ptr() == kv.k_pool.untyped_storage().data_ptr()
    assert shares_pool == (layout == "consecutive")
    runs = kv.block_runs(kv.k_pool, 0)  # views of the pool, one per run of consecutive ids
    assert [r.shape[0] for r in runs] == {"consecutive": [5], "two runs": [3, 2], "shuffled": [1, 1, 1, 2]}[layout]
    assert all(r.untyped_storage().data_ptr() == kv.k_pool.untyped_storage().data_ptr() for r in runs)
    assert torch.equal(torch.cat(runs), blocks)
    gathered = kv.block_runs(kv.k_pool, 0, max_runs=1)  # too many pieces: one gathered copy
    assert len(gathered) == 1 and torch.equal(gathered[0], blocks)


@pytest.mark.parametrize("layout", ["consecutive", "two runs", "shuffled"])
@pytest.mark.parametrize("method", ["full", "exact_topk"])
def test_dense_and_exact_over_blocks_equal_contiguous_cache(layout, method):
    """NaN past L in the last block (and in the spare blocks) must not reach the output."""
    g = torch.Generator().manual_seed(1)
    H, H_kv, L, d = 6, 2, 45, 16
    keys, values = torch.randn(1, H_kv, L, d, generator=g), torch.randn(1, H_kv, L, d, generator=g)
    q = torch.randn(1, H, d, generator=g)
    order = torch.tensor({"consecutive": [2, 3, 4, 5, 6, 7], "two runs": [5, 6, 7, 0, 1, 2],
                          "shuffled": [6, 2, 7, 0, 5, 3]}[layout])
    m = make_method(method) if method == "full" else make_method(method, top_k=12)
    state = m.init_state(H, H_kv, d)
    slots = torch.tensor([state.alloc()])
    want = m.decode(q, PagedKV.contiguous(keys, values), state, slots)
    got = m.decode(q, _pool(keys, values, 8, order, poison=True), state, slots)
    assert torch.isfinite(got.out).all()
    torch.testing.assert_close(got.out, want.out, rtol=1e-5, atol=1e-5)
    if method == "exact_topk":
        assert torch.equal(got.selected.sort(-1).values, want.selected.sort(-1).values)


# bitmap (span <= 4 x 40 candidates), int32 sort keys, and int64 once rows * span overflows int32
@pytest.mark.parametrize("span", [100, 1000, 2 ** 30])
def test_unique_rows_is_sorted_distinct_and_left_packed(span):
    g = torch.Generator().manual_seed(2)
    cand = torch.randint(0, min(span, 60), (3, 40), generator=g) * max(1, span // 60)  # many duplicates
    cand[0, :2] = span - 1  # the last position, twice
    cand[1, 5:] = -1  # padding
    cand[2] = -1  # a row with nothing
    out = _unique_rows(cand, span)
    assert out.dtype == torch.long
    for row in range(3):
        want = sorted({int(x) for x in cand[row] if x >= 0})
        got = out[row]
        assert got[:len(want)].tolist() == want and (got[len(want):] == -1).all()
    assert out.shape[1] == max(1, max(len({int(x) for x in r if x >= 0}) for r in cand))
