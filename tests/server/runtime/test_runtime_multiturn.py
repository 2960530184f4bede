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
