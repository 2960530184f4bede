"""The prefix cache (runtime/prefix_cache.py) against the same runner with the cache off: a prompt that starts
with cached blocks prefills only the rest, and yet its greedy tokens and its method state (ReTopK's FIFOs,
Quest's page bounds, every method's) equal those of a full prefill, whether it shares no block, one, many or
all of them, or its shared part ends inside a block. Then the blocks' lifecycle: reference counts, eviction
under the budget (idle blocks only, least recently used first) and the namespaces."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig
from retopk_server.runtime.budget import BudgetExceeded
from retopk_server.runtime.prefix_cache import block_hashes, namespace

KEY = namespace("alice")
# every method of the registry, sized for the tiny model so that none of them attends to everything
METHODS = [
    MethodSpec("full"),
    MethodSpec.of("exact_topk", top_k=8),
    # tau 0 and no dense floor: every step reuses the seeded FIFO, so a seed that differed would show
    MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, refresh_every=0, tau=0.0, dense_below=0),
    MethodSpec.of("retopk", top_k=8, cache_size=6, window=2, tau=0.85, tau_calibration=0.8, dense_below=0),
    MethodSpec.of("quest", top_k=8, page_size=4),
    MethodSpec.of("loki", top_k=8, rank=4),
    MethodSpec.of("sparq", top_k=8),
    MethodSpec.of("streaming_llm", top_k=8, sinks=2),
    MethodSpec.of("tokenselect", top_k=12, initial=2, local=2, threshold=0.5),
]
A = prompt_ids(40, seed=1)  # the first prompt: 10 blocks of 4
OTHER = prompt_ids(40, seed=2)
# name -> (the second prompt, the tokens its cache hit covers with blocks and chunks of 4 and no tail kept)
CASES = {
    "no block": (OTHER[:30], 0),
    "one block": (A[:4] + OTHER[:26], 4),
    "many blocks, ending inside one": (A[:26] + OTHER[:10], 24),
    "every block": (list(A), 36),  # the last block stays: the prompt's last token is prefilled
    "every block and more": (A + OTHER[:10], 40),
}


def slot_state(runner, session) -> list[dict[str, torch.Tensor]]:
    """Per layer, every field of the session's method state as ``read_slot`` exports it (a slot's FIFO rows past its
    fill hold whatever the memory held and are never read)."""
    group = runner._groups[session.method]
    return [state.read_slot(slot) for state, slot in zip(group.states, session.slots, strict=True)]


def greedy_from(runner, session, prompt: list[int], n: int, prefix_key=None) -> tuple[list[int], list, int]:
    """(n greedy tokens, the method state right after the prefill, tokens the cache supplied)."""
    job = runner.start_prefill(session, prompt, prefix_key)
    logits = job.step(job.remaining)
    state = slot_state(runner, session)
    out = [int(logits.argmax())]
    while len(out) < n:
        logits, _ = runner.decode([session], [out[-1]])
        out.append(int(logits[0].argmax()))
    return out, state, job.cached


@pytest.mark.parametrize("spec", METHODS, ids=lambda s: s.name + "".join(f",{k}={v}" for k, v in s.params)[:40])
def test_a_cache_hit_equals_a_full_prefill_for_every_method(spec):
    model = tiny_model("llama")
    cached = runner_for(model, spec, kv_block_size=4, prefill_chunk=4)
    plain = runner_for(model, spec, kv_block_size=4, prefill_chunk=4, prefix_cache=False)
    keep = cached.prefill_queries(cached.open_session())  # ReTopK leaves its last C tokens to the prefill
    with torch.inference_mode():
        for runner in (cached, plain):  # both, so that their state pools grow alike (Quest's page count)
            greedy_from(runner, runner.open_session(), A, 2, KEY)  # caches A's ten blocks
        assert len(cached.prefix_cache) == 10
        for name, (prompt, hit) in CASES.items():
            hit = min(hit, max(0, len(prompt) - max(1, keep)) // 4 * 4)
            want_tokens, want_state, none = greedy_from(plain, plain.open_session(), prompt, 6, KEY)
            assert none == 0
            tokens, state, got = greedy_from(cached, cached.open_session(), prompt, 6, KEY)
            assert got == hit, name
            assert tokens == want_tokens, name
            for layer, (a, b) in enumerate(zip(state, want_state, strict=True)):
                for field in a.keys() & b.keys():  # bit for bit: the same chunks computed the same keys and queries
                    assert torch.equal(a[field], b[field]), (name, layer, field)


def test_the_retopk_fifo_after_a_hit_holds_the_prompts_last_queries():
    """Not only equal to a full prefill's: a full FIFO, seeded from the prompt's last C queries, whose tokens
    the hit left uncached (C = 6 is not a block multiple: the hit stops at the block before them)."""
    spec = METHODS[3]
    runner = runner_for(tiny_model("llama"), spec, kv_block_size=4, prefill_chunk=4)
    with torch.inference_mode():
        runner.prefill(runner.open_session(), A, KEY)
        session = runner.open_session()
        job = runner.start_prefill(session, A + OTHER[:3], KEY)
        job.step(job.remaining)
    assert job.cached == 36  # 43 - 6 = 37 positions may come from the cache: 9 whole blocks
    for state, slot in zip(runner._groups[spec].states, session.slots, strict=True):
        assert int(state.fill[slot]) == 6 and bool((state.support[slot] >= 0).any())


# prompt -> the tokens its hit covers, with blocks of 4, chunks of 8 and A's (then the third prompt's) blocks cached
TAIL_CASES = [
    ("past the last boundary by less than C: A's tail queries", A + OTHER[:2], 40),
    ("a boundary A kept no queries at: its last C tokens are prefilled", A[:32] + OTHER[:3], 24),
    ("past the boundary by C or more: none needed", A + OTHER[:12], 40),
    ("one more token than that prompt: its own tail queries", A + OTHER[:12] + [7], 48),
]


@pytest.mark.parametrize("spec", [METHODS[2], METHODS[3], MethodSpec("full"), METHODS[4]],
                         ids=["retopk C=4", "retopk C=6", "full", "quest"])
def test_a_hit_past_the_last_queries_takes_them_from_the_cache(spec):
    """A hit may end fewer than C tokens before the prompt's end when the cache kept the queries of the C positions
    before that boundary: the prefill computes only the tokens after it, and still the method state (the FIFO
    seeded from the prompt's last C queries) and the greedy tokens equal a full prefill's, bit for bit."""
    model = tiny_model("llama")
    cached = runner_for(model, spec, kv_block_size=4, prefill_chunk=8)
    plain = runner_for(model, spec, kv_block_size=4, prefill_chunk=8, prefix_cache=False)
    Q = cached.prefill_queries(cached.open_session())
    with torch.inference_mode():
        for runner in (cached, plain):
            greedy_from(runner, runner.open_session(), A, 2, KEY)
        # A's last whole chunk ends at 40: the queries of 40 - Q .. 39 are kept beside its tenth block
        kept = cached.prefix_cache.queries(block_hashes(KEY, A, 4)[9])
        assert (kept is None) == (Q == 0)
        if kept is not None:
            info = cached.info
            assert kept.shape == (info.num_layers, info.num_heads, Q, info.head_dim)
            assert cached.prefix_cache.query_bytes == kept.numel() * 4
        for name, prompt, hit in TAIL_CASES:
            hit = hit if Q else (len(prompt) - 1) // 8 * 8 if name.startswith("a boundary") else hit
            want_tokens, want_state, _ = greedy_from(plain, plain.open_session(), prompt, 6, KEY)
            tokens, state, got = greedy_from(cached, cached.open_session(), prompt, 6, KEY)
            assert got == hit, name
            assert tokens == want_tokens, name
            for layer, (a, b) in enumerate(zip(state, want_state, strict=True)):
                for field in a.keys() & b.keys():
                    assert torch.equal(a[field], b[field]), (name, layer, field)
    if Q:
        assert int(state[0]["fill"]) == Q  # seeded from Q queries, Q - 1 of them the cache's


def test_tail_queries_count_against_the_budget_and_go_with_their_block():
    spec = METHODS[2]
    runner = runner_for(tiny_model("llama"), spec, kv_block_size=4, prefill_chunk=8)
    with torch.inference_mode():
        session = runner.open_session()
        runner.prefill(session, A, KEY)
        assert runner.prefix_cache.evict() == 0  # the session holds the blocks: nothing goes
        runner.close_session(session)
        kept, info = runner.prefix_cache.query_bytes, runner.info
        assert kept == info.num_layers * info.num_heads * 4 * info.head_dim * 4  # layers x heads x C x d float32
        reserved = runner.budget.reserved
        assert runner.prefix_cache.evict() == 10
        assert runner.prefix_cache.query_bytes == 0 and runner.budget.reserved == reserved - kept


def test_hits_stop_on_the_prefill_grid():
    """Chunks of 8 over blocks of 4: a hit covers whole chunks, so the rest is prefilled in the chunks of a full
    prefill, and the logits are those of the cache off bit for bit."""
    model = tiny_model("qwen2")
    runner = runner_for(model, kv_block_size=4, prefill_chunk=8)
    plain = runner_for(model, kv_block_size=4, prefill_chunk=8, prefix_cache=False)
    prompt = A[:28] + OTHER[:5]  # 7 shared blocks, 3.5 chunks
    with torch.inference_mode():
        runner.prefill(runner.open_session(), A, KEY)
        job = runner.start_prefill(runner.open_session(), prompt, KEY)
        logits = job.step(job.remaining)
        assert job.cached == 24
        assert torch.equal(logits, plain.prefill(plain.open_session(), prompt))


def test_cached_blocks_are_shared_and_outlive_their_sessions():
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    with torch.inference_mode():
        first = runner.open_session()
        runner.prefill(first, A[:18], KEY)  # 4 full blocks cached, the partial fifth is the session's own
        assert len(runner.prefix_cache) == 4 and runner.pool.used_blocks == 5
        second = runner.open_session()
        job = runner.start_prefill(second, A[:16] + OTHER[:5], KEY)
        assert job.cached == 16 and second.blocks[:4] == first.blocks[:4]
        assert all(runner.pool.holders(b) == 3 for b in first.blocks[:4])  # two sessions and the cache
        job.step(job.remaining)
        runner.close_session(first)
        runner.close_session(second)
        memory = runner.memory()
        # the cache alone holds its blocks now: idle, not used by any session, given back on demand
        assert runner.pool.used_blocks == 5 and runner.prefix_cache.idle_blocks == 5
        assert memory.kv_used == 0 and memory.prefix_cache_blocks == 5
        assert memory.prefix_cache_idle_bytes == memory.prefix_cache_bytes == 5 * runner.pool.block_nbytes
        assert runner.prefix_cache.clear() == 5 and runner.pool.used_blocks == 0


def test_an_aborted_hit_gives_its_blocks_back():
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    with torch.inference_mode():
        first = runner.open_session()
        runner.prefill(first, A, KEY)
        runner.close_session(first)
        session = runner.open_session()
        job = runner.start_prefill(session, A[:24] + OTHER[:12], KEY)
        assert runner.prefix_cache.idle_blocks == 4
        job.step(4)
        job.abort()
        assert session.length == 0 and session.blocks == []
        assert runner.prefix_cache.idle_blocks == 10  # the mapped blocks are the cache's alone again


def test_namespaces_and_salts_do_not_share_blocks():
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    hits = {}
    with torch.inference_mode():
        runner.prefill(runner.open_session(), A, namespace("alice"))
        for name, key in {"bob": namespace("bob"), "alice salted": namespace("alice", "s1"),
                          "alice": namespace("alice"), "nobody": None}.items():
            job = runner.start_prefill(runner.open_session(), A[:20] + OTHER[:4], key)
            job.step(job.remaining)
            hits[name] = job.cached
    assert hits == {"bob": 0, "alice salted": 0, "alice": 20, "nobody": 0}
    # global sharing: the owner drops out of the namespace, the salt stays
    assert namespace("alice", shared=True) == namespace("bob", shared=True) != namespace("bob", "s", shared=True)
    assert namespace("a", "bc") != namespace("ab", "c")
    assert block_hashes(namespace("a"), A[:8], 4) != block_hashes(namespace("b"), A[:8], 4)


def test_a_later_turn_is_neither_looked_up_nor_cached():
    """Positions after a decode step went through the session's method: never cached, nor reused by a turn."""
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    with torch.inference_mode():
        runner.prefill(runner.open_session(), A, KEY)
        session = runner.open_session()
        runner.prefill(session, A[:10], KEY)  # 8 tokens hit, the session's first prefill
        runner.decode([session], [A[10]])
        job = runner.start_prefill(session, A[11:], KEY)
        job.step(job.remaining)
        assert job.cached == 0 and len(runner.prefix_cache) == 10


def test_idle_cached_blocks_make_room_before_the_budget_refuses():
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    with torch.inference_mode():
        held = runner.open_session()
        runner.prefill(held, OTHER[:16], KEY)  # 4 cached blocks a session still holds
        runner.prefill(runner.open_session(), A[:16], namespace("bob"))
        for s in [s for s in runner.sessions.values() if s is not held]:
            runner.close_session(s)
        assert runner.prefix_cache.idle_blocks == 4 and runner.pool.free_blocks == 0  # 8 initial blocks
        runner.budget.limit = runner.budget.reserved  # the pool cannot grow
        session = runner.open_session()
        runner.prefill(session, prompt_ids(12, seed=5))  # 3 blocks: only evicting idle cached ones gives them
        assert len(runner.prefix_cache) == 5 and runner.prefix_cache.idle_blocks == 1
        # the least recently used went first: bob's chain, from its tail (its head stays reachable)
        head = runner.prefix_cache.lookup(block_hashes(namespace("bob"), A[:16], 4), 4)
        assert len(head) == 1
        runner.pool.release(head)
        with pytest.raises(BudgetExceeded):  # the blocks a session holds are never evicted
            runner.prefill(runner.open_session(), prompt_ids(24, seed=6))
        assert len(runner.prefix_cache) == 4 and all(runner.pool.holders(b) == 2 for b in held.blocks)


@pytest.mark.slow
def test_the_servers_default_retopk_on_the_embedded_model(embedded_model):
    """The default method (K = 64, C = W = 128, dense below 1K) on the real model: a 1.3K-token prompt whose
    first 1,100 tokens were prefilled before takes two whole chunks from the cache, seeds its FIFOs from the
    same 128 last queries and decodes the same greedy tokens as with the cache off (sparse steps: past 1K);
    so does a prompt that extends the whole 1,536-token document by 20 tokens, 108 of whose 128 last queries
    come from the cache."""
    model, tokenizer = embedded_model
    config = dict(kv_cache_bytes=256 << 20)
    cached = ModelRunner(RuntimeConfig(**config), model=model, tokenizer=tokenizer)
    plain = ModelRunner(RuntimeConfig(prefix_cache=False, **config), model=model, tokenizer=tokenizer)
    g = torch.Generator().manual_seed(0)
    document = torch.randint(100, 40000, (1536,), generator=g).tolist()
    question = torch.randint(100, 40000, (200,), generator=g).tolist()
    # 4 blocks of 256 = 2 chunks of 512, the last 128 tokens prefilled in any case; then the whole document
    # (3 chunks) with the queries of its positions 1408 .. 1535 from the cache, 20 tokens prefilled
    cases = [(document[:1100] + question, 1024), (document + question[:20], 1536)]
    with torch.inference_mode():
        cached.prefill(cached.open_session(), document, KEY)
        for prompt, want_hit in cases:
            tokens, state, hit = greedy_from(cached, cached.open_session(), prompt, 8, KEY)
            want_tokens, want_state, _ = greedy_from(plain, plain.open_session(), prompt, 8, KEY)
            assert hit == want_hit
            assert tokens == want_tokens
            for layer, (a, b) in enumerate(zip(state, want_state, strict=True)):
                assert int(b["fill"]) == 128
                for field in ("queries", "support", "fill", "ptr", "step", "tau"):
                    assert torch.equal(a[field], b[field]), (layer, field)


def test_a_rewind_into_a_cached_block_copies_it_before_writing():
    """An edited chat history rewinds a session into its first prompt's blocks, which the prefix cache (and any
    session that mapped them) holds: the partly kept block is copied, the cached one stays as it was."""
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4)
    with torch.inference_mode():
        session = runner.open_session()
        runner.prefill(session, A, KEY)
        shared = session.blocks[4]
        before = [runner.pool.k[layer][shared].clone() for layer in range(2)]
        assert runner.rewind(session, 18) == 18  # 4 blocks and 2 tokens of the fifth
        assert session.blocks[4] != shared and runner.pool.holders(shared) == 1  # the cache's alone now
        runner.prefill(session, OTHER[:6])  # writes positions 18.. into the session's copy
        assert all(torch.equal(runner.pool.k[layer][shared], before[layer]) for layer in range(2))
        # the cached prefix still serves a new prompt, which continues exactly as a cold prefill would
        plain = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=4, prefix_cache=False)
        tokens, _, cached = greedy_from(runner, runner.open_session(), A[:30], 4, KEY)
        assert cached == 28 and tokens == greedy_from(plain, plain.open_session(), A[:30], 4)[0]


def test_a_first_prompt_waits_for_a_prefill_under_way_only_where_that_prefill_will_cache_more_of_its_start():
    """runner.waits_for_prefix, with blocks of 4 and chunks of 8 (a hit covers whole grids of 8 tokens): a prompt
    whose start a started prefill will cache (same namespace, same tokens, a grid or more) waits; one that shares
    less than a grid, another namespace or nothing, a later turn, or a prompt whose start is cached already,
    does not."""
    runner = runner_for(tiny_model("llama"), kv_block_size=4, prefill_chunk=8)
    first = runner.start_prefill(runner.open_session(), A, KEY)  # under way: nothing fed, nothing cached yet

    def waits(prompt, key=KEY, session=None):
        return runner.waits_for_prefix(session or runner.open_session(), prompt, key, [first])

    assert waits(A[:16] + OTHER[:8]) and waits(A[:12] + OTHER[:12])  # 2 grids; 3 blocks, cut to 1 grid
    assert not waits(A[:4] + OTHER[:20])  # one block: less than a grid
    assert not waits(A[:16] + OTHER[:8], namespace("bob")) and not waits(A[:16] + OTHER[:8], None)
    assert not waits(OTHER[:24]) and not runner.waits_for_prefix(runner.open_session(), A, KEY, [])
    later = runner.open_session()
    runner.prefill(later, OTHER[:5])
    assert not waits(A[:16] + OTHER[:8], session=later)  # a later turn looks nothing up
    first.step(first.remaining)
    assert not waits(A[:16] + OTHER[:8])  # its start is cached now: waiting would gain nothing
    longer = runner.start_prefill(runner.open_session(), A + OTHER[:16], KEY)
    assert runner.waits_for_prefix(runner.open_session(), A + OTHER[:16], KEY, [longer])  # more than is cached
