"""ModelRunner.make_room: the pools grown once for sessions about to be imported (a restart's saved sessions), so
that their imports grow nothing; within the cache budget, never past it."""

from __future__ import annotations

import torch
from runtime_helpers import greedy, prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec

SPEC = MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, tau=0.5, refresh_every=5)


def exported(model, count: int):
    a = runner_for(model, SPEC, kv_block_size=4)
    states = []
    for i in range(count):
        s = a.open_session()
        greedy(a, s, prompt_ids(13 + 3 * i, seed=i), 3)
        states.append(a.export_session(s))
    return states


def capacities(runner) -> tuple[int, int]:
    return runner.pool.capacity, runner.method_group(SPEC).states[0].capacity


def test_after_make_room_the_imports_grow_no_pool_and_hold_what_was_exported():
    model = tiny_model("llama")
    states = exported(model, 6)
    plain = runner_for(model, SPEC, kv_block_size=4)
    before = capacities(plain)
    for state in states:
        plain.import_session(state)
    assert capacities(plain)[0] > before[0] and capacities(plain)[1] > before[1]  # without it, both grow

    b = runner_for(model, SPEC, kv_block_size=4)
    b.make_room([(state.length, SPEC) for state in states])
    sized = capacities(b)
    assert b.pool.free_blocks >= sum(b.pool.blocks_for(state.length) for state in states)
    assert b.method_group(SPEC).states[0].free_slots >= len(states)
    assert sized[0] <= plain.pool.capacity  # just enough, not a doubling past it
    b.trim_pools()  # an idle engine's pass: the room stays for the sessions to come
    assert capacities(b) == sized
    sessions = []
    for state in states:
        sessions.append(b.import_session(state))
        again = b.export_session(sessions[-1])
        assert torch.equal(again.positions(again.k), state.positions(state.k))
        assert all(torch.equal(again.state[f], t) for f, t in state.state.items())
    assert capacities(b) == sized
    for session in sessions:  # each session's next turn crosses into a new block: still no doubling of the pool
        b.reserve(session, b.pool.blocks_for(session.length) * b.pool.block_size + 1)
    assert capacities(b) == sized


def test_make_room_stays_within_the_cache_budget_and_skips_a_method_it_cannot_build():
    model = tiny_model("llama")
    states = exported(model, 2)
    small = runner_for(model, SPEC, kv_block_size=4)
    budget = small.budget.reserved + 3 * small.pool.block_nbytes  # room for a few blocks, not the 1,000 asked
    b = runner_for(model, SPEC, kv_block_size=4, kv_cache_bytes=budget)
    blocks = b.pool.capacity
    b.make_room([(4000, SPEC), (10, MethodSpec.of("retopk", top_k=0))])  # top_k 0: not a method to build
    assert blocks < b.pool.capacity < 1000 and b.budget.reserved <= b.budget.limit  # grown as far as it fits
    b.make_room([])
    b.import_session(states[0])  # the budget it left still holds a session


def test_a_session_closed_before_the_others_come_does_not_give_their_room_back():
    model = tiny_model("llama")
    states = exported(model, 4)
    b = runner_for(model, SPEC, kv_block_size=4)
    b.make_room([(state.length, SPEC) for state in states])
    sized = capacities(b)
    b.close_session(b.import_session(states[0]))  # its client came back and closed it before the others
    b.trim_pools()  # an idle engine's pass
    kept = capacities(b)
    assert b.pool.free_blocks >= sum(b.pool.blocks_for(state.length) for state in states[1:])
    assert b.method_group(SPEC).states[0].free_slots >= len(states) - 1
    for state in states[1:]:
        b.import_session(state)
    assert capacities(b) == kept and kept[0] <= sized[0]  # the others found their room: nothing grew

    c = runner_for(model, SPEC, kv_block_size=4)
    c.make_room([(state.length, SPEC) for state in states])
    assert c.pool.trim() == 0 and c.trim_pools() == 0 and capacities(c) == sized
    assert c.pool.trim(pressure=True) > 0 and c.trim_pools(pressure=True) > 0  # memory short: the room goes back
