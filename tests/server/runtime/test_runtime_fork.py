"""ModelRunner.fork (n > 1 from one prefill): every fork continues exactly as a session that prefilled the same
prompt itself, with the same method-state decisions, and the shared KV blocks are freed only by their last holder."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec
from retopk_server.runtime.budget import BudgetExceeded


@pytest.mark.parametrize("length", [32, 35])  # the prompt ends on a block boundary (block 4), and inside one
def test_forks_continue_like_a_session_that_prefilled_the_prompt_itself(length):
    runner = runner_for(tiny_model("llama"), kv_block_size=4)
    # no dense floor and tau 0: every step reuses the cached supports, so a fork without the copied FIFOs
    # (an empty cache: fallback) would take other paths than the plain session
    spec = MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, refresh_every=0, tau=0.0,
                         dense_below=0)
    prompt, feed = prompt_ids(length, seed=length), prompt_ids(12, seed=7)
    with torch.inference_mode():
        plain, source = runner.open_session(spec), runner.open_session(spec)
        ref_logits = runner.prefill(plain, prompt)
        torch.testing.assert_close(runner.prefill(source, prompt), ref_logits)
        used_before = runner.pool.used_blocks
        forks = runner.fork(source, 3)
        # the full blocks are shared, only a partial last block is a new one per fork
        partial = length % 4 != 0
        assert runner.pool.used_blocks == used_before + 3 * partial
        for fork in forks:
            assert fork.token_ids == source.token_ids and fork.method == spec
            assert fork.blocks[:length // 4] == source.blocks[:length // 4]
        rows = [plain, source, *forks]
        for step, t in enumerate(feed):
            if step == 6:  # the source goes: its forks keep the blocks they share with it
                runner.close_session(source)
                rows.remove(source)
            logits, stats = runner.decode(rows, [t] * len(rows), with_stats=True)
            for i in range(1, len(rows)):
                torch.testing.assert_close(logits[i], logits[0], atol=1e-5, rtol=1e-5)
                # the copied query-support caches make the same reuse / fallback decisions per head
                assert torch.equal(stats[i].path, stats[0].path)
            assert int((stats[0].path == 0).sum()) > 0  # reuse happened: the FIFOs were read
        for fork in forks:
            runner.close_session(fork)
        runner.close_session(plain)
    assert runner.pool.used_blocks == 0


def test_a_fork_that_does_not_fit_opens_nothing():
    runner = runner_for(tiny_model("llama"), kv_block_size=4)
    with torch.inference_mode():
        source = runner.open_session()
        runner.prefill(source, prompt_ids(18, seed=3))
        assert runner.pool.free_blocks == 3  # 8 initial blocks, 5 hold the 18 tokens
        runner.budget.limit = runner.budget.reserved  # no growth: room for three forks' partial blocks, not four
        open_before = set(runner.sessions)
        with pytest.raises(BudgetExceeded):
            runner.fork(source, 4)
        assert set(runner.sessions) == open_before
        runner.close_session(source)
    assert runner.pool.used_blocks == 0
