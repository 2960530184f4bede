"""KV pool compaction (KVPool.compact, ModelRunner._compact): used blocks move to the lowest ids and every holder
follows, so the pool gives back free blocks that lie between used ones (closed sessions', evicted cached ones),
not only a free tail; and the prefix cache's cap on idle bytes (RuntimeConfig.prefix_cache_bytes). The moved
sessions go on exactly as if nothing had moved: their greedy tokens equal those of a runner where nothing did."""

from __future__ import annotations

import dataclasses

import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec
from retopk_server.runtime.kv_pool import KVPool
from retopk_server.runtime.prefix_cache import namespace

SPEC = MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, refresh_every=0, tau=0.0, dense_below=0)
KEY = namespace("alice")


def decode_greedy(runner, session, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        logits, _ = runner.decode([session], [tok])
        tok = int(logits[0].argmax())
        out.append(tok)
    return out


def test_compact_moves_the_used_blocks_down_with_their_contents_and_holders():
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, block_size=2, dtype=torch.float32, device="cpu",
                  initial_blocks=8)
    ids = pool.alloc(8)
    for b in ids:
        for layer in range(2):
            pool.k[layer][b] = b
            pool.v[layer][b] = -b
    pool.share([6])  # two holders
    pool.release([0, 1, 2, 4])  # used: 3, 5, 6, 7
    moved = pool.compact()
    assert moved == {5: 0, 6: 1, 7: 2}  # 3 stays: it is below the four used blocks
    assert pool.holders(1) == 2  # block 6's second holder moved with it
    assert pool.free_blocks == 4 and pool.alloc(4) == [4, 5, 6, 7]  # the free blocks are the tail now
    pool.release([4, 5, 6, 7])
    for old, new in moved.items():
        assert all(bool((pool.k[layer][new] == old).all() and (pool.v[layer][new] == -old).all()) for layer in range(2))
    assert pool.compact() == {}  # nothing above the used ones any more


def test_a_closed_sessions_blocks_below_a_live_one_are_given_back():
    """Without compaction the pool keeps its size while a live session's blocks sit at its top."""
    model = tiny_model("llama")
    runner = runner_for(model, SPEC, kv_block_size=4, prefill_chunk=4, prefix_cache=False)
    plain = runner_for(model, SPEC, kv_block_size=4, prefill_chunk=4, prefix_cache=False)
    prompt = prompt_ids(8, seed=3)
    with torch.inference_mode():
        big = runner.open_session()
        runner.prefill(big, prompt_ids(56, seed=4))  # 14 blocks: the pool grows to 16
        live = runner.open_session()
        first = int(runner.prefill(live, prompt).argmax())  # blocks 14, 15
        assert live.blocks == [14, 15] and runner.pool.capacity == 16
        runner.close_session(big)
        assert live.blocks == [0, 1] and runner.pool.capacity == 8  # moved down, the pool trimmed
        got = decode_greedy(runner, live, first, 6)
        ref = plain.open_session()
        want = decode_greedy(plain, ref, int(plain.prefill(ref, prompt).argmax()), 6)
    assert got == want


def test_a_method_state_finds_the_room_idle_cached_blocks_held_between_sessions():
    """The gap the live memory test ran around: idle cached blocks below a live session's blocks, the budget
    spent, and a new session's method state must grow. Evicting them frees pool blocks, but not the pool's tail:
    only moving the live blocks down lets the pool give the bytes back to the budget."""
    model = tiny_model("llama")
    runner = runner_for(model, SPEC, kv_block_size=4, prefill_chunk=4)
    plain = runner_for(model, SPEC, kv_block_size=4, prefill_chunk=4, prefix_cache=False)
    p2, p3, p4 = prompt_ids(8, seed=5), prompt_ids(4, seed=6), prompt_ids(6, seed=7)
    with torch.inference_mode():
        cached = runner.open_session()
        runner.prefill(cached, prompt_ids(56, seed=8), KEY)  # 14 blocks, cached
        s2 = runner.open_session()
        first2 = int(runner.prefill(s2, p2).argmax())  # blocks 14, 15 (no key: not cached)
        runner.close_session(cached)  # its blocks stay, idle, in the cache
        assert runner.prefix_cache.idle_blocks == 14 and runner.pool.capacity == 16
        runner.budget.limit = runner.budget.reserved  # nothing may grow any more
        s3 = runner.open_session()
        first3 = int(runner.prefill(s3, p3).argmax())  # the free method slot; one idle block evicted for its KV
        s4 = runner.open_session()
        runner.prefill(s4, p4)  # the method state grows: the cache's idle blocks go, the live ones move down
        assert len(runner.prefix_cache) == 0 and max(s2.blocks + s3.blocks + s4.blocks) < runner.pool.capacity
        assert runner.budget.reserved <= runner.budget.limit
        got = [decode_greedy(runner, s2, first2, 5), decode_greedy(runner, s3, first3, 5)]
        want = []
        for prompt in (p2, p3):
            ref = plain.open_session()
            want.append(decode_greedy(plain, ref, int(plain.prefill(ref, prompt).argmax()), 5))
    assert got == want


def test_the_cap_on_idle_cached_bytes_evicts_least_recently_used_first():
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    block = runner.pool.block_nbytes
    runner.config = dataclasses.replace(runner.config, prefix_cache_bytes=3 * block)
    with torch.inference_mode():
        a, b = runner.open_session(), runner.open_session()
        runner.prefill(a, prompt_ids(16, seed=9), KEY)  # 4 cached blocks
        runner.prefill(b, prompt_ids(8, seed=10), KEY)  # 2 more, used later
        runner.close_session(a)
        assert runner.prefix_cache.idle_blocks == 3  # a's oldest block went (its chain's tail first)
        runner.close_session(b)
        assert runner.prefix_cache.idle_blocks == 3 and runner.prefix_cache.idle_bytes() <= 3 * block
