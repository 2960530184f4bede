"""The embedded SmolLM2-135M-Instruct (real weights) through the runtime: equals transformers' generate,
answers the capital question, batches like it decodes alone. Uses the root session fixture ``embedded_model``
(loaded once per pytest process); the runner leaves that model as it found it."""

from __future__ import annotations

import pytest
import torch

from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig, Sampler, SamplingParams, StopChecker
from retopk_server.runtime.runtime_config import DEFAULT_METHOD_PARAMS

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
POEM = [{"role": "user", "content": "Write two sentences about the sea."}]


@pytest.fixture(scope="module")
def runner(embedded_model):
    model, tokenizer = embedded_model
    return ModelRunner(RuntimeConfig(prefill_chunk=16), model=model, tokenizer=tokenizer)


def generate_text(runner, session, prompt: list[int], max_new: int = 40) -> tuple[list[int], str]:
    """The engine's loop, written out: prefill, sample greedily, stop at EOS, feed back."""
    sampler = Sampler(SamplingParams())
    stop = StopChecker(runner.tokenizer, list(runner.info.eos_token_ids), [])
    logits = runner.prefill(session, prompt)
    ids, text = [], ""
    for _ in range(max_new):
        tok = sampler.sample(logits, ids, prompt)
        ids.append(tok)
        delta, stopped = stop.push(tok)
        text += delta
        if stopped:
            break
        logits = runner.decode([session], [tok])[0][0]
    return ids, text + stop.flush()


def test_model_info(runner):
    info = runner.info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.max_context == 8192 and info.vocab_size == 49152 and 2 in info.eos_token_ids
    assert info.default_method == MethodSpec.of("retopk", **DEFAULT_METHOD_PARAMS)
    assert dict(info.default_method.params)["top_k"] == 64
    # the GGUF file has no generation config: unset sampling fields take the chat defaults
    assert dict(info.sampling_defaults) == {"temperature": 0.7, "top_p": 0.9}
    assert "chat defaults" in info.sampling_source


def test_capital_of_france_is_paris_with_the_default_method(runner):
    session = runner.open_session()
    ids, text = generate_text(runner, session, runner.encode_chat(QUESTION))
    assert "Paris" in text
    assert ids[-1] in runner.info.eos_token_ids
    runner.close_session(session)


def test_full_greedy_equals_generate_on_real_weights(runner, embedded_model):
    model, _ = embedded_model
    prompt = runner.encode_chat(POEM)
    ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    session = runner.open_session(MethodSpec("full"))
    ids, _ = generate_text(runner, session, prompt, max_new=30)
    assert ids == ref
    runner.close_session(session)


def test_batched_sessions_decode_as_alone(runner):
    prompts = [runner.encode_chat(QUESTION), runner.encode_chat(POEM)]
    alone = []
    for p in prompts:
        s = runner.open_session(MethodSpec("full"))
        alone.append(generate_text(runner, s, p, max_new=12)[0])
        runner.close_session(s)
    sessions = [runner.open_session(MethodSpec("full")) for _ in prompts]
    outs = [[int(runner.prefill(s, p).argmax())] for s, p in zip(sessions, prompts, strict=True)]
    for _ in range(11):
        logits, _ = runner.decode(sessions, [o[-1] for o in outs])
        for o, row in zip(outs, logits, strict=True):
            o.append(int(row.argmax()))
    for o, a in zip(outs, alone, strict=True):
        assert o[:len(a)] == a  # alone stops at EOS; batched runs on
    for s in sessions:
        runner.close_session(s)
