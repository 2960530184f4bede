"""fork_prefix: a session given another's prefix and then prefilled the rest equals one prefilled whole."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec


@pytest.mark.parametrize("split", [8, 13, 40])  # a block boundary (block 4), inside a block, most of the prompt
def test_forked_prefix_then_prefill_equals_plain_prefill(split):
    runner = runner_for(tiny_model("llama"), kv_block_size=4)
    prompt = prompt_ids(48, seed=split)
    spec = MethodSpec.of("retopk", top_k=8, cache_size=4, window=4)
    with torch.inference_mode():
        plain = runner.open_session(spec)
        ref = runner.prefill(plain, prompt)
        donor, forked = runner.open_session(MethodSpec("full")), runner.open_session(spec)
        runner.prefill(donor, prompt[:split])
        runner.fork_prefix(donor, [forked], split)
        runner.close_session(donor)  # the fork copied the keys and values: the donor can go
        got = runner.prefill(forked, prompt[split:])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert forked.token_ids == plain.token_ids
        for t in prompt_ids(5, seed=99):
            a, _ = runner.decode([plain], [t])
            b, _ = runner.decode([forked], [t])
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert runner.prefill_queries(forked) == 4  # ReTopK observes its last C prompt queries


def test_fork_prefix_refuses_a_non_empty_target_and_a_length_past_the_source():
    runner = runner_for(tiny_model("llama"))
    with torch.inference_mode():
        source, target = runner.open_session(), runner.open_session()
        runner.prefill(source, prompt_ids(10, seed=1))
        with pytest.raises(ValueError, match="length"):
            runner.fork_prefix(source, [target], 11)
        runner.prefill(target, prompt_ids(3, seed=2))
        with pytest.raises(ValueError, match="empty"):
            runner.fork_prefix(source, [target], 5)
