"""KV block pool: content survives growth, growth is by doubling (in place on the CPU within a budget), sessions
report and free their memory."""

from __future__ import annotations

import ctypes
import mmap
import time
from pathlib import Path

import pytest
import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec, kv_pool
from retopk_server.runtime.attention import HOLD_S
from retopk_server.runtime.budget import CacheBudget
from retopk_server.runtime.kv_pool import KVPool
from retopk_server.runtime.reserved_rows import reserve


def test_pool_write_and_history_round_trip_across_growth():
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=3, block_size=4, dtype=torch.float32, device="cpu",
                  initial_blocks=2)
    g = torch.Generator().manual_seed(0)
    blocks, written_k, written_v = [], [], []
    capacities = []
    for chunk in (3, 6, 1, 9, 5):  # 24 positions = 6 blocks: the pool grows 2 -> 4 -> 8
        start = sum(k.shape[1] for k in written_k)
        need = pool.blocks_for(start + chunk) - len(blocks)
        blocks += pool.alloc(need)
        capacities.append(pool.capacity)
        k, v = torch.randn(1, 2, chunk, 3, generator=g), torch.randn(1, 2, chunk, 3, generator=g)
        table = pool.block_table([blocks], "cpu")
        pool.write(1, pool.rows(table, torch.tensor([start]), k.shape[2]), k, v)
        written_k.append(k[0])
        written_v.append(v[0])
    got_k, got_v = pool.history(1, torch.tensor(blocks), 24)  # (H_kv, 24, d)
    torch.testing.assert_close(got_k, torch.cat(written_k, dim=1), rtol=0, atol=0)
    torch.testing.assert_close(got_v, torch.cat(written_v, dim=1), rtol=0, atol=0)
    assert capacities == [2, 4, 4, 8, 8]
    dense_k, _ = pool.paged(1, pool.block_table([blocks], "cpu"), torch.tensor([24])).dense()
    torch.testing.assert_close(dense_k[0], got_k, rtol=0, atol=0)


def test_step_rows_are_the_rows_of_one_new_position_a_row():
    """A decode step's rows from Python ints (``step_rows``) equal ``rows``' tensor arithmetic for T = 1 on a ragged
    batch of scattered blocks, positions at block starts, ends and in between, and one row by hand."""
    pool = KVPool(num_layers=1, num_kv_heads=3, head_dim=2, block_size=4, dtype=torch.float32, device="cpu",
                  initial_blocks=16)
    block_lists = [[5], [2, 9, 0], [7, 1], [3, 4, 6, 8]]
    positions = [0, 11, 4, 13]
    got = pool.step_rows(block_lists, positions, "cpu")  # (B, H_kv, 1)
    want = pool.rows(pool.block_table(block_lists, "cpu"), torch.tensor(positions), 1)
    assert got.dtype == torch.long and got.shape == (4, 3, 1)
    assert torch.equal(got, want)
    assert got[3, 2, 0] == (8 * 3 + 2) * 4 + 1  # position 13: the row's block 3 (id 8), head 2, offset 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_as_stored_is_what_history_reads_back(dtype):
    """A prefill chunk that starts a session attends over ``as_stored`` of its own keys and values instead of
    gathering them back (attention.py's _prefill): that equals ``history`` bit for bit, strided keys included, and
    so do the CPU library's store of one position at a time (a decode step's) and torch's of a chunk's."""
    pool = KVPool(num_layers=1, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype, device="cpu")
    blocks = pool.alloc(pool.blocks_for(11))
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(1, 11, 6, 16, generator=g) * torch.logspace(-6, 4, 16)  # (1, T, heads, d): wide exponents
    k, v = qkv[:, :, 2:4].transpose(1, 2), qkv[:, :, 4:].transpose(1, 2)  # (1, H_kv, T, d), strided as the layers'
    pool.write(0, pool.rows(pool.block_table([blocks], "cpu"), torch.tensor([0]), 11), k, v)
    got_k, got_v = pool.history(0, torch.tensor(blocks), 11)  # (H_kv, 11, d)
    assert pool.as_stored(k).dtype == torch.float32
    assert torch.equal(pool.as_stored(k)[0].to(dtype), got_k) and torch.equal(pool.as_stored(v)[0].to(dtype), got_v)
    # one position at a time (a decode step's writes take the CPU library's store): the same bytes
    for t in range(11):
        pool.write(0, pool.rows(pool.block_table([blocks], "cpu"), torch.tensor([t]), 1), k[:, :, t:t + 1] * 2,
                   v[:, :, t:t + 1] * 2)
    assert torch.equal(pool.history(0, torch.tensor(blocks), 11)[0], pool.as_stored(k * 2)[0].to(dtype))


def test_a_float16_pool_saturates_keys_and_values_beyond_its_range():
    """float16's finite range ends at 65504: torch's cast makes a larger float32 ±inf, and attention over a key or
    value of ±inf is NaN. Both writers (a prefill chunk's torch cast, a decode step's CPU library store, one
    position at a time) store a value beyond the range as ±65504 and every other value rounded as the cast
    rounds it (NaN stays NaN), and attention over the stored positions stays finite."""
    big = torch.tensor([7e4, -1e5, 65520.0, -65519.0, 3e38, float("inf")])  # 65520 rounds to inf; 65519 to 65504
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(1, 1, 6, 16, generator=g), torch.randn(1, 1, 6, 16, generator=g)  # (1, H_kv, T, d)
    k[0, 0, :, 3], v[0, 0, :, 5] = big, -big
    saturated = torch.where(big.abs() > 65504, big.sign() * 65504, big)  # then exact in float16
    for chunked in (True, False):
        pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=16, block_size=8, dtype=torch.float16, device="cpu")
        blocks = pool.alloc(1)
        table = pool.block_table([blocks], "cpu")
        if chunked:
            pool.write(0, pool.rows(table, torch.tensor([0]), 6), k, v)
        else:
            for t in range(6):
                pool.write(0, pool.rows(table, torch.tensor([t]), 1), k[:, :, t:t + 1], v[:, :, t:t + 1])
        got_k, got_v = pool.history(0, torch.tensor(blocks), 6)  # (H_kv, 6, d) float16
        assert torch.equal(got_k[0, :, 3].float(), saturated) and torch.equal(got_v[0, :, 5].float(), -saturated)
        rest = torch.ones(16, dtype=torch.bool)
        rest[3] = rest[5] = False
        assert torch.equal(got_k[0][:, rest], k[0, 0][:, rest].half())
        assert torch.equal(got_v[0][:, rest], v[0, 0][:, rest].half())
        assert torch.equal(pool.as_stored(k)[0].half(), got_k)
        q = torch.randn(2, 16, generator=g).unsqueeze(0)  # (1, H, d): two query heads of the one KV head
        pool_kv = pool.paged(0, table, torch.tensor([6]))
        out = torch.softmax(q[0] @ pool_kv.keys(0, 0).float().T * 0.25, -1) @ pool_kv.values(0, 0).float()  # (H, d)
        assert torch.isfinite(out).all()
    assert kv_pool.to_pool_dtype(torch.tensor([float("nan")]), torch.float16).isnan().all()


def test_pool_reuses_released_blocks():
    pool = KVPool(1, 1, 2, 4, torch.float32, "cpu", initial_blocks=4)
    a = pool.alloc(3)
    pool.release(a)
    assert pool.free_blocks == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3] and pool.capacity == 4


def test_pool_hands_out_consecutive_blocks_when_it_can():
    pool = KVPool(1, 1, 2, 4, torch.float32, "cpu", initial_blocks=16)
    a, b, c = pool.alloc(4), pool.alloc(4), pool.alloc(4)
    assert (a, b, c) == ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11])
    pool.release(a)
    pool.release(c)  # free: 0-3 and 8-15
    assert pool.alloc(6) == [8, 9, 10, 11, 12, 13]  # the lowest run long enough, not 0-3 + 8-9
    assert pool.alloc(1, after=3) == [0]  # block 4 is taken: the lowest free id
    assert pool.alloc(2, after=13) == [14, 15]  # a growing session continues in place
    assert pool.alloc(4) == [16, 17, 18, 19] and pool.capacity == 32  # 3 free: grown, the new ids are a run
    assert pool.alloc(3, after=19) == [20, 21, 22]
    assert pool.free_blocks == 32 - 20

    full = KVPool(1, 1, 2, 4, torch.float32, "cpu", initial_blocks=8)
    full.alloc(8)
    full.release([1, 3, 5])
    assert full.alloc(2) == [1, 3] and full.capacity == 8  # fragmented but enough: no growth, lowest ids


def test_long_decode_grows_the_pool_a_logarithmic_number_of_times():
    runner = runner_for(tiny_model("llama"), kv_block_size=2)
    s = runner.open_session()
    runner.prefill(s, prompt_ids(3, seed=0))
    capacities = {runner.pool.capacity}
    for t in range(200):
        runner.decode([s], [t % 256])
        capacities.add(runner.pool.capacity)
    assert s.length == 203 and len(s.blocks) == 102
    assert s.blocks == list(range(102))  # grown in place: the dense and exact paths read it without a copy
    assert sorted(capacities) == [8 * 2**i for i in range(len(capacities))]  # doubling only
    assert max(capacities) < 2 * 102 * 2


def test_session_memory_is_reported_and_freed_on_close():
    model = tiny_model("qwen2")
    runner = runner_for(model, kv_block_size=8)
    spec = MethodSpec.of("retopk", top_k=16, cache_size=4, window=4, recall=2)
    s = runner.open_session(spec)
    runner.prefill(s, prompt_ids(20, seed=3))
    layers, heads, kv_heads, d = 2, 4, 2, 16
    mem = s.nbytes()
    assert mem["kv"] == 3 * layers * 2 * kv_heads * 8 * d * 4  # 3 blocks of 8 positions, keys and values, fp32
    # per layer: unit queries (H, C, d) fp32 + supports (H, C, K) int64 + fill, ptr, step int64 + tau (H,) fp32
    # + refresh period (H,) int64
    assert mem["method_state"] == layers * (heads * 4 * d * 4 + heads * 4 * 16 * 8 + 3 * 8 + heads * 4 + heads * 8)
    full = runner.open_session(MethodSpec("full"))
    assert full.nbytes() == {"kv": 0, "method_state": 0}

    used_before, slots = runner.pool.used_blocks, s.slots
    runner.close_session(s)
    assert runner.pool.used_blocks == used_before - 3 and s.closed and s.id not in runner.sessions
    runner.close_session(s)  # idempotent
    with pytest.raises(ValueError, match="not open"):
        runner.prefill(s, [1])
    again = runner.open_session(spec)
    assert again.slots is None and again.nbytes()["method_state"] == 0  # allocated at its first prefill
    runner.prefill(again, [1, 2])
    assert again.slots == slots  # the freed state slots are handed out again


def test_empty_sessions_hold_no_method_state_and_pools_shrink_back_when_sessions_close():
    """Issue 31: 63 empty sessions reserved 27 MB of method state each, and closing them gave nothing back.
    Method state is now allocated at a session's first prefill, and the pools give back what they no longer
    need once the sessions close (the KV pool down to its initial blocks, the state pools to one slot once the
    slots' hold has passed)."""
    runner = runner_for(tiny_model("llama"), MethodSpec.of("retopk", top_k=8, cache_size=4, window=4),
                        kv_block_size=4)
    idle = runner.memory()
    empty = [runner.open_session() for _ in range(20)]
    assert runner.memory() == idle and all(s.nbytes() == {"kv": 0, "method_state": 0} for s in empty)
    busy = [runner.open_session() for _ in range(9)]
    for i, s in enumerate(busy):
        runner.prefill(s, prompt_ids(30, seed=i))
    grown = runner.memory()
    state = runner._groups[runner.config.default_method].states[0]
    assert state.capacity == 16 and grown.kv_reserved > 4 * idle.kv_reserved
    assert grown.method_state_reserved == 16 * idle.method_state_reserved  # one slot's worth when idle
    for s in busy[1:] + empty:
        runner.close_session(s)
    # the state pools keep the burst's slots for HOLD_S (a load that comes back reuses them)
    assert state.capacity == 16 and runner.memory().kv_reserved < grown.kv_reserved
    group = runner.method_group(runner.config.default_method)
    group.clock = lambda: group.peak_at + HOLD_S + 1  # ... and once that has passed, a close gives them back
    extra = runner.open_session()
    runner.prefill(extra, [1, 2])
    runner.close_session(extra)
    assert state.capacity == 1
    group.clock = time.monotonic
    runner.close_session(busy[0])
    assert state.capacity == 1 and runner.memory() == idle
    assert runner.budget.reserved == idle.kv_reserved + idle.method_state_reserved


def test_bad_sessions_and_batches_are_refused():
    runner = runner_for(tiny_model("llama"))
    with pytest.raises(ValueError, match="unknown method"):
        runner.open_session(MethodSpec("nope"))
    with pytest.raises(ValueError, match="top_k"):
        runner.open_session(MethodSpec.of("exact_topk", top_k=0))
    s = runner.open_session(session_id="a")
    with pytest.raises(ValueError, match="already open"):
        runner.open_session(session_id="a")
    runner.prefill(s, [1, 2])
    with pytest.raises(ValueError, match="twice"):
        runner.decode([s, s], [1, 2])
    with pytest.raises(ValueError, match="equal length"):
        runner.decode([s], [1, 2])
    # invariants: the wire refuses such ids naming the field; reaching the runner they are a caller's bug
    with pytest.raises(AssertionError, match="empty"):
        runner.prefill(s, [])
    with pytest.raises(AssertionError, match="256 is not a token id"):
        runner.prefill(s, [5, 256])
    with pytest.raises(AssertionError, match="-1 is not a token id"):  # would index the table from its end
        runner.prefill(s, [-1])
    assert s.length == 2


def test_method_spec_is_canonical_and_validated():
    assert MethodSpec.of("retopk", top_k=8, tau=0.5) == MethodSpec("retopk", (("tau", 0.5), ("top_k", 8)))
    assert hash(MethodSpec.of("retopk", top_k=8, tau=0.5)) == hash(MethodSpec.of("retopk", tau=0.5, top_k=8))
    with pytest.raises(ValueError, match="repeats"):
        MethodSpec("retopk", (("top_k", 8), ("top_k", 9)))
    with pytest.raises(ValueError, match="hashable"):
        MethodSpec.of("retopk", top_k=[8])
    with pytest.raises(ValueError, match="unknown method"):
        MethodSpec("nope").build()
    assert MethodSpec.of("exact_topk", top_k=8).build(backend="torch").top_k == 8
    assert MethodSpec("full").build(backend="torch", not_a_param=1).name == "full"  # unknown defaults dropped


def test_a_budgeted_cpu_pool_grows_in_place_and_trims_its_pages_back(monkeypatch):
    """The pool reserves the budget's blocks once (reserved_rows.py): a growth widens the views, the storage stays
    (no copy of the blocks in use), the new blocks read as zero, the budget counts the blocks viewed; a trim
    narrows them and the blocks given back read as zero when the pool grows again."""
    monkeypatch.setattr(KVPool, "_resized", None)  # growing by copying would fail here
    block = 2 * 2 * 1 * 256 * 64 * 4  # (k, v) x 2 layers x H_kv 1 x P 256 x d 64 x float32: 16 pages a layer's block
    budget = CacheBudget(64 * block)
    pool = KVPool(2, 1, 64, 256, torch.float32, "cpu", initial_blocks=2, budget=budget)
    storage = [t.data_ptr() for t in pool.k + pool.v]
    held = pool.alloc(2)
    for t in pool.k + pool.v:
        t[held] = 1.0
    more = pool.alloc(3)  # 2 -> 8 blocks
    assert pool.capacity == 8 and [t.data_ptr() for t in pool.k + pool.v] == storage
    assert all(bool((t[held] == 1).all()) and not bool(t[2:].any()) for t in pool.k + pool.v)
    assert budget.reserved == pool.nbytes() == 8 * block
    for t in pool.k + pool.v:
        t[more] = 2.0
    pool.release(more)
    assert pool.trim() == 6 * block and pool.capacity == 2 and budget.reserved == 2 * block
    pool.alloc(5)
    assert pool.capacity == 8 and [t.data_ptr() for t in pool.k + pool.v] == storage
    assert all(bool((t[held] == 1).all()) and not bool(t[2:].any()) for t in pool.k + pool.v)


def resident(t: torch.Tensor) -> float:
    """The share of the pages wholly inside ``t``'s memory that are resident (mincore(2))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    start = -(-t.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = (t.data_ptr() + t.nbytes - start) // mmap.PAGESIZE
    vec = ctypes.create_string_buffer(pages)
    assert libc.mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec.raw) / pages


def test_a_reserved_pool_commits_its_initial_blocks_and_the_room_it_makes():
    """The blocks a reserved pool starts with, and those ``make_free`` adds for sessions about to come, are written
    at once: else the first sessions' imports and turns would fault their pages in one by one (the restart's
    first session paid for it)."""
    pool = KVPool(2, 1, 64, 256, torch.float32, "cpu", initial_blocks=2, budget=CacheBudget(1 << 26))
    assert pool.capacity == 2 and all(resident(t) == 1.0 for t in pool.k + pool.v)
    pool.make_free(6)
    assert pool.capacity == 6 and all(resident(t) == 1.0 for t in pool.k + pool.v)
    assert all(not bool(t.any()) for t in pool.k + pool.v)


def test_a_pool_grows_by_copying_where_the_reservation_is_refused(monkeypatch):
    monkeypatch.setattr(kv_pool, "reserve", lambda *args: None)
    pool = KVPool(1, 1, 2, 4, torch.float32, "cpu", initial_blocks=2, budget=CacheBudget(1 << 20))
    pool.k[0][:] = 1.0
    before = pool.k[0].data_ptr()
    pool.alloc(3)
    assert pool.capacity == 4 and pool.k[0].data_ptr() != before
    assert bool((pool.k[0][:2] == 1).all()) and not bool(pool.k[0][2:].any())


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_a_reservation_is_not_charged_to_the_overcommit_accounting():
    """ReservedRows maps MAP_NORESERVE ("nr" in the mapping's VmFlags): a large pool's untouched address space
    does not count against the machine's memory, so the process can still fork() beside it."""
    rows = reserve(1 << 16, (64,), torch.float32)  # 16 MiB, far past what it will hold
    assert rows is not None
    rows.view(4)[:] = 1.0
    assert "nr" in vm_flags(rows.base.data_ptr())
