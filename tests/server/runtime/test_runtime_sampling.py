"""Sampling against small references computed by hand from the definitions in sampling.py's docstring."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from retopk_server.runtime.sampling import Sampler, SamplingParams, apply_penalties, filter_logits, greedy_tokens

NEG = float("-inf")


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 1.5), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("seed", -1),
    ("temperature", float("nan")),
])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_is_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert Sampler(SamplingParams()).sample(logits, [], []) == 1


def test_penalties_follow_their_formulas():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    prompt, generated = [1], [0, 3, 3]
    got = apply_penalties(logits, params, generated, prompt)
    expected = [
        2.0 / 2 - 0.5 - 0.25 * 1,  # token 0: generated once, positive logit divided
        -1.0 * 2,  # token 1: prompt only: repetition penalty, no presence/frequency
        0.5,  # token 2: never seen
        3.0 / 2 - 0.5 - 0.25 * 2,  # token 3: generated twice
        -0.5,
    ]
    torch.testing.assert_close(got, torch.tensor(expected))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5]))  # the input is not modified


def test_repetition_penalty_changes_the_greedy_choice():
    logits = torch.tensor([1.0, 1.5, 0.0])
    assert Sampler(SamplingParams(repetition_penalty=2.0)).sample(logits, [1], []) == 0


def kept(logits: torch.Tensor, **kw) -> set[int]:
    out = filter_logits(logits, SamplingParams(temperature=1.0, **kw))
    return {i for i, v in enumerate(out.tolist()) if v != NEG}


def test_top_k_keeps_the_k_largest():
    assert kept(torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0]), top_k=2) == {3, 4}
    assert kept(torch.tensor([1.0, 3.0, 2.0]), top_k=5) == {0, 1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()  # descending: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    assert kept(logits, top_p=0.45) == {1}
    assert kept(logits, top_p=0.55) == {1, 3}
    assert kept(logits, top_p=0.9) == {1, 3, 0}
    assert kept(logits, top_p=0.99) == {0, 1, 2, 3}


def test_min_p_keeps_tokens_above_a_fraction_of_the_best():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    assert kept(logits, min_p=0.2) == {0, 1, 3}  # threshold 0.1
    assert kept(logits, min_p=0.7) == {1}  # threshold 0.35


def test_filters_compose_in_order():
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    # top-k 3 leaves {1, 3, 0} renormalised to 0.526, 0.316, 0.158; top-p 0.6 then keeps {1, 3}
    assert kept(logits, top_k=3, top_p=0.6) == {1, 3}


def test_temperature_sampling_matches_the_tempered_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    T = 0.7
    probs = torch.softmax(logits / T, dim=0)
    sampler = Sampler(SamplingParams(temperature=T, seed=1234))
    n = 6000
    counts = torch.bincount(torch.tensor([sampler.sample(logits, [], []) for _ in range(n)]), minlength=4)
    # 4 standard deviations of a binomial proportion at n = 6000 is below 0.026
    assert (counts / n - probs).abs().max() < 4 * math.sqrt(0.25 / n)


def test_samples_stay_inside_the_filtered_set():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    allowed = set(torch.topk(logits, 3).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=7))
    drawn = {sampler.sample(logits, [], []) for _ in range(300)}
    assert drawn == allowed


def test_seed_makes_sampling_reproducible():
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(256, generator=g) for _ in range(40)]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(p):
        s = Sampler(p)
        return [s.sample(x, [], []) for x in steps]

    assert run(params) == run(params)
    assert run(params) != run(SamplingParams(temperature=1.0, top_p=0.95, seed=43))


# ---- log-probabilities: log_softmax of the penalised, tempered logits, before the truncations -----------

def _log_softmax(xs: list[float]) -> list[float]:
    """From the definition: x - log(sum(exp(x)))."""
    lse = math.log(sum(math.exp(x) for x in xs))
    return [x - lse for x in xs]


def test_greedy_logprob_is_the_log_softmax_of_the_argmax_and_top_is_sorted():
    logits = [0.1, 2.0, -1.0, 1.9, 0.5]
    sampler = Sampler(SamplingParams(), logprobs=3)
    token = sampler.sample(torch.tensor(logits), [], [])
    logprob, top = sampler.last_logprobs
    ref = _log_softmax(logits)
    assert token == 1 and logprob == pytest.approx(ref[1], abs=1e-6)
    assert [t for t, _ in top] == [1, 3, 4]  # the three largest, most likely first; the greedy token leads
    assert [v for _, v in top] == pytest.approx([ref[1], ref[3], ref[4]], abs=1e-6)


def test_logprobs_follow_the_penalties_and_temperature_but_not_the_truncations():
    logits = [2.0, -1.0, 0.4, 3.0, -0.5]
    T = 0.5
    params = SamplingParams(temperature=T, top_k=1, repetition_penalty=2.0, presence_penalty=0.5, seed=0)
    sampler = Sampler(params, logprobs=5)
    token = sampler.sample(torch.tensor(logits), [0, 3, 3], [1])
    # the formulas of test_penalties_follow_their_formulas (no frequency penalty here), divided by T
    penalised = [2.0 / 2 - 0.5, -1.0 * 2, 0.4, 3.0 / 2 - 0.5, -0.5]
    ref = _log_softmax([x / T for x in penalised])
    logprob, top = sampler.last_logprobs
    assert token == 3  # top_k 1 keeps only the best penalised logit (token 3: 1.0; token 0 drops to 0.5)
    assert logprob == pytest.approx(ref[token], abs=1e-5)
    assert sorted(t for t, _ in top) == [0, 1, 2, 3, 4]  # tokens top-k removed still have their finite logprob
    assert dict(top) == pytest.approx(dict(enumerate(ref)), abs=1e-5)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_logprobs_off_by_default_and_top_zero_gives_only_the_token():
    logits = torch.tensor([0.0, 1.0])
    off = Sampler(SamplingParams())
    off.sample(logits, [], [])
    assert off.last_logprobs is None
    only = Sampler(SamplingParams(), logprobs=0)
    only.sample(logits, [], [])
    assert only.last_logprobs == (pytest.approx(_log_softmax([0.0, 1.0])[1]), ())


# ---- defaults for unset fields: the model's generation config, else the embedded model's, else chat defaults --

def test_defaults_come_from_the_generation_config_first():
    from transformers import GenerationConfig

    from retopk_server.runtime.sampling_defaults import CHAT_DEFAULTS, CHAT_DEFAULTS_SOURCE, model_defaults

    qwen_like = GenerationConfig(do_sample=True, temperature=0.6, top_p=0.8, top_k=20, repetition_penalty=1.05)
    got, source = model_defaults(qwen_like)
    assert dict(got) == pytest.approx({"temperature": 0.6, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
    assert "generation config" in source
    assert model_defaults(GenerationConfig()) == (CHAT_DEFAULTS, CHAT_DEFAULTS_SOURCE)  # sets no sampling field
    assert model_defaults(None)[0] == CHAT_DEFAULTS
    # a value the sampler refuses is skipped, not fatal
    odd = SimpleNamespace(temperature=0.6, top_p=2.0, top_k=None)
    assert dict(model_defaults(odd)[0]) == {"temperature": 0.6}


def test_a_request_overrides_only_the_fields_it_sets():
    from retopk_server.runtime.sampling_defaults import resolve, resolved_fields

    defaults = (("temperature", 0.2), ("top_p", 0.9))
    assert resolve({}, defaults) == SamplingParams(temperature=0.2, top_p=0.9)
    assert resolve({"temperature": 0.0}, defaults).greedy  # temperature 0 stays greedy
    assert resolve({"top_k": 5, "seed": 3}, defaults) == SamplingParams(temperature=0.2, top_p=0.9, top_k=5, seed=3)
    with pytest.raises(ValueError, match="top_p"):
        resolve({"top_p": 0.0}, defaults)
    fields = resolved_fields(defaults)
    assert fields["temperature"] == 0.2 and fields["top_k"] == 0 and "seed" not in fields


def test_greedy_tokens_of_a_batch_equal_each_plain_greedy_rows_sample():
    """One argmax over the plain greedy rows gives what each of their samplers draws; a row with a penalty,
    log-probabilities or a temperature is left to its own sampler."""
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    samplers = [Sampler(SamplingParams()), Sampler(SamplingParams(repetition_penalty=1.3)),
                Sampler(SamplingParams(), logprobs=2), Sampler(SamplingParams(temperature=0.8, seed=1)),
                Sampler(SamplingParams(seed=3))]
    picked = greedy_tokens(samplers, logits)
    assert sorted(picked) == [0, 4]
    for row, token in picked.items():
        assert token == samplers[row].sample(logits[row], [], [])
    assert greedy_tokens(samplers[1:4], logits[1:4]) == {}


def test_greedy_tokens_take_the_first_of_equal_maxima_as_argmax_does():
    """Rows the width of a vocabulary with ties for the maximum (within and across SIMD lanes' strides, and a
    row of equal values): each row's token is torch.argmax's, the first maximal index."""
    torch.manual_seed(1)
    logits = torch.randn(6, 49152)
    for row, places in enumerate([(7, 8), (3, 40000), (16, 32), (49150, 49151), (0, 49151)]):
        logits[row, list(places)] = 9.0
    logits[5] = 0.0
    picked = greedy_tokens([Sampler(SamplingParams()) for _ in range(6)], logits)
    assert picked == {row: int(torch.argmax(logits[row])) for row in range(6)}
    assert [picked[row] for row in range(5)] == [7, 3, 16, 49150, 0] and picked[5] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_tokens_of_rows_with_nan_or_any_dtype_are_argmaxs(dtype):
    """A NaN logit (a broken row) is torch.argmax's pick, the first NaN, whatever numpy or torch takes the argmax
    (bfloat16 logits stay in torch); a row with -inf everywhere but one token picks that token."""
    torch.manual_seed(2)
    logits = torch.randn(4, 3000).to(dtype)
    logits[1, [2500, 40]] = float("nan")
    logits[2] = float("-inf")
    logits[2, 1234] = 0.0
    logits[3, 17] = float("inf")
    picked = greedy_tokens([Sampler(SamplingParams()) for _ in range(4)], logits)
    assert picked == {row: int(torch.argmax(logits[row])) for row in range(4)}
    assert picked[1] == 40 and picked[2] == 1234 and picked[3] == 17
