"""method=full greedy decoding through the runtime equals transformers' generate, token for token."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import greedy, prompt_ids, reference_greedy, runner_for, tiny_model

from retopk_server.runtime import MethodSpec


@pytest.mark.parametrize("prompt_len,chunk,block", [(37, 512, 8), (37, 16, 8), (70, 7, 256), (5, 3, 4)])
def test_full_greedy_equals_generate(arch, prompt_len, chunk, block):
    model = tiny_model(arch)
    prompt = prompt_ids(prompt_len, seed=prompt_len)
    expected = reference_greedy(model, prompt, 24)
    runner = runner_for(model, prefill_chunk=chunk, kv_block_size=block)
    assert greedy(runner, runner.open_session(), prompt, 24) == expected


def test_prefill_logits_match_model_forward(arch):
    model = tiny_model(arch)
    prompt = prompt_ids(50, seed=1)
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    runner = runner_for(model, prefill_chunk=13, kv_block_size=4)
    got = runner.prefill(runner.open_session(), prompt)
    assert got.dtype == torch.float32 and got.shape == (256,)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_model_is_left_usable_by_transformers():
    """The runner switches the attention implementation only during its own forwards."""
    model = tiny_model("llama")
    before = model.config._attn_implementation
    runner = runner_for(model)
    runner.prefill(runner.open_session(), prompt_ids(10, seed=2))
    assert model.config._attn_implementation == before
    prompt = prompt_ids(12, seed=3)
    assert reference_greedy(model, prompt, 5) == reference_greedy(tiny_model("llama"), prompt, 5)


def test_batched_decode_equals_alone_with_sessions_joining(arch):
    """Continuous batching: sessions of different lengths join between steps and leave; each one's tokens
    equal transformers' generate on its own prompt."""
    model = tiny_model(arch)
    prompts = [prompt_ids(n, seed=10 + n) for n in (9, 41, 23)]
    n_new = [20, 12, 16]
    join_at = [0, 3, 7]  # decode step at which each session is prefilled and joins the batch
    expected = [reference_greedy(model, p, n) for p, n in zip(prompts, n_new, strict=True)]
    runner = runner_for(model, kv_block_size=4)
    outs: list[list[int]] = [[] for _ in prompts]
    sessions = [None] * len(prompts)
    for step in range(60):
        for i, at in enumerate(join_at):
            if at == step:
                sessions[i] = runner.open_session()
                outs[i].append(int(runner.prefill(sessions[i], prompts[i]).argmax()))
        active = [i for i in range(len(prompts)) if sessions[i] is not None and len(outs[i]) < n_new[i]]
        if not active and step > max(join_at):
            break
        if active:
            logits, stats = runner.decode([sessions[i] for i in active], [outs[i][-1] for i in active])
            assert stats is None and logits.shape == (len(active), 256)
            for row, i in enumerate(active):
                outs[i].append(int(logits[row].argmax()))
    assert outs == expected


def test_mixed_methods_in_one_step_equal_each_alone():
    """One forward with rows of three methods gives each row what it gets decoding alone."""
    model = tiny_model("llama", layers=3)
    specs = [MethodSpec("full"), MethodSpec.of("exact_topk", top_k=8),
             MethodSpec.of("retopk", top_k=8, cache_size=4, window=4, recall=2, tau=0.5, refresh_every=5)]
    prompts = [prompt_ids(n, seed=n) for n in (30, 45, 38)]
    alone = []
    for spec, p in zip(specs, prompts, strict=True):
        r = runner_for(model, spec, kv_block_size=8)
        alone.append(greedy(r, r.open_session(), p, 15))
    runner = runner_for(model, kv_block_size=8)
    sessions = [runner.open_session(spec) for spec in specs]
    outs = [[int(runner.prefill(s, p).argmax())] for s, p in zip(sessions, prompts, strict=True)]
    for _ in range(14):
        logits, _ = runner.decode(sessions, [o[-1] for o in outs])
        for o, row in zip(outs, logits, strict=True):
            o.append(int(row.argmax()))
    assert outs == alone
    assert outs[0] != outs[1] or outs[0] != outs[2]  # the methods really differ on this context


def test_prefill_in_query_row_blocks_equals_generate(monkeypatch):
    """A long chunk is split into query-row blocks when its score matrix exceeds the budget."""
    from retopk_server.runtime import attention

    monkeypatch.setattr(attention, "PREFILL_SCORES_BUDGET", 4 * 5 * 60)  # 4 heads: ~5 rows of 60 keys per block
    model = tiny_model("qwen2")
    prompt = prompt_ids(57, seed=8)
    expected = reference_greedy(model, prompt, 10)
    runner = runner_for(model, prefill_chunk=40, kv_block_size=8)
    assert greedy(runner, runner.open_session(), prompt, 10) == expected
