"""A session keeps its KV cache (and method state) between turns: two turns equal one prefill of the whole
conversation followed by decoding (full attention)."""

from __future__ import annotations

from runtime_helpers import greedy, prompt_ids, reference_greedy, runner_for, tiny_model


def test_two_turns_equal_one_prefill_of_the_conversation(arch):
    model = tiny_model(arch)
    turn1, turn2 = prompt_ids(21, seed=1), prompt_ids(15, seed=2)
    runner = runner_for(model, prefill_chunk=8, kv_block_size=4)
    s = runner.open_session()
    answer1 = greedy(runner, s, turn1, 10)  # the cache holds turn1 + answer1[:-1]
    assert s.length == len(turn1) + 9 and s.token_ids == turn1 + answer1[:-1]
    # the second turn prefills only what the cache lacks: the last answer token and the new user turn
    answer2 = greedy(runner, s, [answer1[-1]] + turn2, 12)
    assert s.length == len(turn1) + len(answer1) + len(turn2) + 11

    whole = turn1 + answer1 + turn2
    fresh = runner_for(model, prefill_chunk=8, kv_block_size=4)
    assert greedy(fresh, fresh.open_session(), whole, 12) == answer2
    assert reference_greedy(model, whole, 12) == answer2


def test_retopk_state_survives_between_turns():
    """The query-support cache and its decode-step counter carry over: with T_r = 5 the refresh falls on the
    5th decode step of the session, which is the 2nd step of the second turn."""
    from retopk_core.methods.base import Path
    from retopk_server.runtime import MethodSpec

    spec = MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, tau=0.0, refresh_every=5)
    runner = runner_for(tiny_model("llama"), spec)
    s = runner.open_session()
    runner.prefill(s, prompt_ids(30, seed=1))
    paths = []
    for t in range(4):  # t_dec = 0..3
        paths.append(runner.decode([s], [t], with_stats=True)[1][0].path)
    runner.prefill(s, prompt_ids(12, seed=2))  # second turn: no reset
    for t in range(2):  # t_dec = 4, 5
        paths.append(runner.decode([s], [t], with_stats=True)[1][0].path)
    refreshed = [bool((p == Path.REFRESH).all()) for p in paths]
    assert refreshed == [False, False, False, False, False, True]
