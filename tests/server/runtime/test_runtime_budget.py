"""The cache budget at the runtime: the KV block pool and the method-state pools grow within it, all
layers or none (an allocation that fails half-way leaves every layer as it was), give bytes back when
trimmed or dropped, and refuse what does not fit with BudgetExceeded before anything changes.
Chunked prefill (PrefillJob) gives the logits of the model's own dense forward wherever the chunks fall,
and an aborted one leaves the session as it was.
"""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import runner_for, tiny_model

from retopk_core.methods.registry import make_method
from retopk_server.runtime import MethodSpec
from retopk_server.runtime.attention import HOLD_S, MethodGroup
from retopk_server.runtime.budget import BudgetExceeded, CacheBudget
from retopk_server.runtime.kv_pool import AllocationFailed, KVPool


def pool(budget_blocks: int | None, initial: int = 2, layers: int = 3) -> KVPool:
    block = 2 * layers * 1 * 4 * 2 * 4  # 2 (k, v) x layers x H_kv 1 x P 4 x d 2 x float32
    budget = CacheBudget(budget_blocks * block) if budget_blocks is not None else None
    return KVPool(layers, 1, 2, 4, torch.float32, "cpu", initial_blocks=initial, budget=budget)


def test_pool_growth_stops_at_the_budget_and_refuses_beyond_it_with_nothing_changed():
    p = pool(budget_blocks=6)
    assert p.budget.reserved == 2 * p.block_nbytes
    p.alloc(3)
    assert p.capacity == 4  # doubled
    p.alloc(2)
    assert p.capacity == 6  # doubling would be 8: capped at the budget's 6
    assert p.budget.reserved == p.budget.limit == 6 * p.block_nbytes
    held = p.alloc(1)
    with pytest.raises(BudgetExceeded) as info:
        p.alloc(1, session_id="s")
    assert info.value.session_id == "s" and info.value.need == p.block_nbytes and info.value.free == 0
    assert p.capacity == 6 and p.free_blocks == 0
    p.release(held)
    assert p.alloc(1) == held  # freed blocks are reused within the budget


def test_pool_growth_is_all_or_nothing_when_an_allocation_fails(monkeypatch):
    p = pool(budget_blocks=None, initial=2)
    blocks = p.alloc(2)
    table = p.block_table([blocks], "cpu")
    for layer in range(p.num_layers):
        p.write(layer, p.rows(table, torch.tensor([0]), 8), torch.full((1, 1, 8, 2), float(layer)),
                torch.ones(1, 1, 8, 2))
    calls = []
    real = KVPool._resized

    def failing(t, blocks_, keep):
        calls.append(1)
        if len(calls) == 4:  # the second layer's values, after three tensors were made
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(t, blocks_, keep)

    monkeypatch.setattr(KVPool, "_resized", staticmethod(failing))
    with pytest.raises(AllocationFailed):
        p.alloc(1)
    assert {t.shape[0] for t in [*p.k, *p.v]} == {2} and p.free_blocks == 0  # every layer as before
    for layer in range(p.num_layers):
        k, _ = p.history(layer, torch.tensor(blocks), 8)
        assert torch.equal(k, torch.full((1, 8, 2), float(layer)))
    monkeypatch.undo()
    p.alloc(1)
    assert {t.shape[0] for t in [*p.k, *p.v]} == {4}


def test_pool_trim_gives_the_unused_tail_back_to_the_budget():
    p = pool(budget_blocks=16, initial=2)
    low, high = p.alloc(2), p.alloc(6)
    assert p.capacity == 8
    p.release(high)
    freed = p.trim()
    assert freed == 6 * p.block_nbytes and p.capacity == 2 and p.budget.reserved == 2 * p.block_nbytes
    assert sorted(low) == [0, 1] and p.free_blocks == 0


def group(budget: CacheBudget | None, layers: int = 3) -> MethodGroup:
    method = make_method("retopk", top_k=4, cache_size=4, window=2)
    return MethodGroup(method, layers, num_heads=2, num_kv_heads=1, head_dim=4, device="cpu", budget=budget)


def test_method_state_pools_keep_a_bursts_slots_for_a_while_and_give_them_up_under_pressure():
    """Streams whose requests end together and come back: after 8 sessions at once all close, the pools keep 8
    slots (before, they shrank to 1 and regrew 1 -> 2 -> 4 -> 8 with the next requests, copying every slot),
    so the next burst grows nothing. The hold counts from when use fell below the peak, not from when the peak
    was reached; past HOLD_S a shrink (a close, the engine's idle pass) gives the slots back, and under memory
    pressure (hold=False) at once."""
    probe = group(None)
    budget = CacheBudget(64 * probe.slot_nbytes())
    g = group(budget)
    now = [100.0]
    g.clock = lambda: now[0]
    per_slot = g.slot_nbytes()

    def burst(n: int) -> list[int]:
        return sorted(g.alloc() for _ in range(n))  # the lowest ids first

    for s in burst(8):
        g.free(s)
        assert g.shrink() == 0
    assert g.states[0].capacity == 8 and g.peak == 8 and budget.reserved == 8 * per_slot
    slots = burst(8)  # the next burst: no growth
    now[0] += 10 * HOLD_S  # a long burst
    for s in slots[2:]:
        g.free(s)
        assert g.shrink() == 0
    assert g.deferred  # kept for the hold: the engine's idle trims shrink it once the hold lapses
    now[0] += HOLD_S + 1
    assert g.shrink() == 6 * per_slot and g.states[0].capacity == 2 and budget.reserved == 2 * per_slot
    for s in slots[:2]:
        g.free(s)
    assert g.shrink() == per_slot and g.states[0].capacity == 1
    for s in burst(4):
        g.free(s)
    assert g.shrink() == 0 and g.states[0].capacity == 4
    assert g.shrink(hold=False) == 3 * per_slot and g.states[0].capacity == 1


def test_method_state_grows_within_the_budget_all_layers_or_none(monkeypatch):
    probe = group(None)
    per_slot = probe.slot_nbytes()
    g = group(CacheBudget(3 * per_slot))
    assert g.budget.reserved == per_slot
    slots = [g.alloc(), g.alloc()]  # capacity 1 -> 2
    assert g.states[0].capacity == 2
    slots.append(g.alloc())  # doubling to 4 would pass the budget: 3
    assert {s.capacity for s in g.states} == {3} and g.budget.reserved == 3 * per_slot
    with pytest.raises(BudgetExceeded):
        g.alloc()
    assert {s.capacity for s in g.states} == {3} and g.used_slots == 3
    g.free(slots.pop())
    assert g.alloc() is not None  # a freed slot is reused without growth

    unbounded = group(None)
    unbounded.alloc()
    real = type(unbounded.states[0]).prepare_grow
    seen = []

    def failing(self, capacity):
        seen.append(1)
        if len(seen) == 2:
            raise torch.OutOfMemoryError("out of memory")
        return real(self, capacity)

    monkeypatch.setattr(type(unbounded.states[0]), "prepare_grow", failing)
    with pytest.raises(AllocationFailed):
        unbounded.alloc()
    assert {s.capacity for s in unbounded.states} == {1} and unbounded.used_slots == 1
    g.close()
    assert g.budget.reserved == 0


def test_runner_refuses_a_prompt_past_the_budget_and_drops_a_methods_pools_with_its_last_session():
    model = tiny_model("llama")
    probe = runner_for(model, kv_block_size=16)
    block = probe.pool.block_nbytes
    start = probe.memory()
    budget = start.kv_reserved + start.method_state_reserved + 4 * block
    runner = runner_for(model, kv_block_size=16, kv_cache_bytes=budget)
    assert runner.memory().budget == budget
    session = runner.open_session()
    with pytest.raises(BudgetExceeded):
        runner.start_prefill(session, list(range(13 * 16)))  # 13 blocks: 8 initial + 4 more do not hold them
    assert session.length == 0 and session.blocks == []
    runner.prefill(session, list(range(12 * 16)))  # exactly the budget's 12 blocks
    assert runner.budget.free < block
    # a session of another method needs pools of its own: they fit once the KV pool gave its free tail back,
    # which it does when the session that held it closes (KVPool.shrink)
    runner.close_session(session)
    assert runner.pool.capacity == 8
    other = MethodSpec("retopk", (("top_k", 4), ("cache_size", 4), ("window", 4)))
    s2 = runner.open_session(other)
    assert other in runner._groups and runner.memory().method_state_used == 0  # no state before its prefill
    runner.prefill(s2, [1, 2, 3])
    assert runner.memory().method_state_used > 0
    runner.close_session(s2)
    assert other not in runner._groups  # dropped with its last session; the default method's pools stay
    usage = runner.memory()
    assert usage.kv_used == 0 and usage.method_state_used == 0
    assert usage.kv_reserved + usage.method_state_reserved == runner.budget.reserved <= budget


@pytest.mark.parametrize("steps", [[1000], [1, 5, 37, 1000], [16] * 20])
def test_chunked_prefill_gives_the_dense_forwards_logits_wherever_the_chunks_fall(steps):
    model = tiny_model("llama")
    prompt = [(7 * i + 3) % 256 for i in range(150)]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1].float()
    runner = runner_for(model, prefill_chunk=32)
    session = runner.open_session()
    job = runner.start_prefill(session, prompt)
    logits = None
    for n in steps:
        logits = job.step(n)
        if logits is not None:
            break
    assert job.remaining == 0 and session.length == len(prompt)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_an_aborted_prefill_leaves_the_session_as_it_was():
    model = tiny_model("llama")
    runner = runner_for(model, MethodSpec("retopk", (("top_k", 8), ("cache_size", 4), ("window", 4))),
                        prefill_chunk=16, kv_block_size=16)
    first = [(5 * i + 1) % 256 for i in range(40)]
    second = [(11 * i + 2) % 256 for i in range(90)]
    a, b = runner.open_session(), runner.open_session()
    runner.prefill(a, first)
    runner.prefill(b, first)
    blocks = list(a.blocks)
    job = runner.start_prefill(a, second)
    job.step(50)
    job.abort()
    assert a.length == len(first) and a.blocks == blocks
    # the aborted session now behaves exactly like one that never saw the aborted tokens
    la, lb = runner.prefill(a, second[:30]), runner.prefill(b, second[:30])
    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)
    for _ in range(5):
        tok = int(la.argmax())
        out, _ = runner.decode([a, b], [tok, tok])
        torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)
        la = out[0]


def _cgroup(root, files: dict[str, str]):
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_available_ram_is_capped_by_the_memory_cgroups_limit(tmp_path):
    """A container's /proc/meminfo is the host's: the cgroup's limit less its usage (inactive page cache not
    counted, as the kernel reclaims it first) caps MemAvailable; without a limit MemAvailable stands."""
    from retopk_server.runtime.budget import available_ram, cgroup_free_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 268435456 kB\nMemAvailable: 200000000 kB\n")  # a 256 GiB host
    gib = 1 << 30
    v2 = _cgroup(tmp_path / "v2", {"memory.max": f"{8 * gib}\n", "memory.current": f"{3 * gib}\n",
                                   "memory.stat": f"anon {2 * gib}\ninactive_file {gib}\nactive_file 5\n"})
    none = tmp_path / "absent"
    assert cgroup_free_bytes(v2, none) == 8 * gib - (3 * gib - gib)
    assert available_ram(meminfo, v2, none) == 6 * gib
    v1 = _cgroup(tmp_path / "v1", {"memory.limit_in_bytes": f"{4 * gib}\n", "memory.usage_in_bytes": f"{5 * gib}\n",
                                   "memory.stat": "cache 7\ntotal_inactive_file 0\n"})
    assert cgroup_free_bytes(none, v1) == 0  # over its limit: nothing left, not a negative budget
    assert available_ram(meminfo, none, v1) == 0
    # No limit (v2 "max", v1's page-rounded 2^63) or no cgroup: the host's MemAvailable.
    v2max = _cgroup(tmp_path / "v2max", {"memory.max": "max\n", "memory.current": "1\n"})
    assert cgroup_free_bytes(v2max, none) is None
    unlimited = _cgroup(tmp_path / "v1max", {"memory.limit_in_bytes": "9223372036854771712\n",
                                             "memory.usage_in_bytes": "1\n"})
    assert cgroup_free_bytes(none, unlimited) is None
    assert available_ram(meminfo, none, none) == 200000000 * 1024
    # A cgroup with room to spare does not raise the figure above MemAvailable.
    roomy = _cgroup(tmp_path / "roomy", {"memory.max": f"{1024 * gib}\n", "memory.current": "0\n"})
    assert available_ram(meminfo, roomy, none) == 200000000 * 1024
