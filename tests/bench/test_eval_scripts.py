"""The evaluation scripts (bench/eval) end to end on a tiny random Llama saved to a temp folder and
loaded by path, with a small byte-level BPE tokenizer and a generated corpus: output structure and
invariants that hold for any model (Full == Exact Top-K with K >= L, ReTopK with tau = 1 == Exact
Top-K, the Full PPL equals transformers' own dense forward, the shared prefill equals a plain one).
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

WORDS = ("the and of to in that he shall unto for his a lord they be is him not them it with all thou was "
         "which my me said but ye their have will are this from thy king upon when were one people house "
         "city river mountain bread water stone field son daughter day night light land went came gave").split()


def make_corpus(n_lines: int = 1500, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        lines.append(" ".join(words).capitalize() + ".")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model dir, corpus path): a 2-layer GQA Llama (4 q heads, 2 KV heads) + BPE tokenizer, saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("eval_tiny")
    text = make_corpus()
    corpus = root / "corpus.txt"
    corpus.write_text(text)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=384, special_tokens=["<eos>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=fast.eos_token_id,
                      bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model_dir = root / "model"
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    fast.save_pretrained(model_dir)
    yield str(model_dir), str(corpus)
    shutil.rmtree(root, ignore_errors=True)


def common_args(tiny) -> list[str]:
    model, corpus = tiny
    return ["--model", model, "--corpus", corpus]


def read_json(out, name) -> dict:
    assert (out / f"{name}.md").is_file()
    return json.loads((out / f"{name}.json").read_text())


# ---- perplexity ----------------------------------------------------------------------------------
def test_perplexity_invariants_and_reference(tiny, tmp_path):
    from bench.eval import perplexity
    from bench.eval.common import split_documents
    from retopk_core.models import load_model

    L, S, K = 200, 24, 16
    methods = "full,exact_topk,retopk:tau=1.0,exact_topk:top_k=1024,retopk"
    res = perplexity.main(common_args(tiny) + ["--methods", methods, "--top-k", str(K), "--lengths", str(L),
                                               "--docs", "2", "--suffix", str(S), "--out", str(tmp_path)])
    data = read_json(tmp_path, "perplexity")
    assert (tmp_path / "perplexity.png").stat().st_size > 0
    per = res["result"][L]
    assert set(per) == {"full", "exact_topk", "retopk tau=1.0", "exact_topk top_k=1024", "retopk"}
    for v in per.values():
        assert len(v["nll"]) == 2 * S and math.isfinite(v["ppl"]) and v["ppl"] > 1
    # K >= L: Exact Top-K attends everything, so it is full attention
    assert per["exact_topk top_k=1024"]["ppl"] == pytest.approx(per["full"]["ppl"], rel=1e-5)
    # tau = 1: every step falls back (or refreshes) to Exact Top-K at the same K
    assert per["retopk tau=1.0"]["ppl"] == pytest.approx(per["exact_topk"]["ppl"], rel=1e-6)
    mix = per["retopk tau=1.0"]["mix"]
    assert mix["reuse"] == 0.0 and mix["exact_path"] == pytest.approx(1.0)
    mix = per["retopk"]["mix"]
    assert mix["reuse"] + mix["fallback"] + mix["refresh"] == pytest.approx(1.0)
    assert 0 < mix["scored_share"] <= 1
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["exact_topk"][f"dppl_{L}"] == 0.0
    # independent reference: transformers' own dense forward over each document
    model, tok = load_model(tiny[0])
    text = open(tiny[1]).read()
    docs = split_documents(text, lambda s: tok.encode(s, add_special_tokens=False), 2, L)
    nll = []
    with torch.no_grad():
        for doc in docs:
            logits = model(torch.tensor([doc])).logits[0].float()  # (L, V)
            logp = torch.log_softmax(logits[L - S - 1:L - 1], -1)
            nll += (-logp.gather(-1, torch.tensor(doc[L - S:]).view(-1, 1))).view(-1).tolist()
    assert per["full"]["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-4)


def test_split_documents_is_deterministic_and_exact_length(tiny):
    from bench.eval.common import split_documents

    text = open(tiny[1]).read()
    encode = lambda s: [ord(c) for c in s]  # noqa: E731 - a character "tokenizer"
    a = split_documents(text, encode, 3, 500)
    assert a == split_documents(text, encode, 3, 500)
    assert [len(d) for d in a] == [500, 500, 500] and len({tuple(d) for d in a}) == 3
    assert all(d[0] != ord(" ") for d in a)  # documents start at a line start


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_default_corpus_strips_verse_references():
    from bench.eval.common import kjv_text

    text = kjv_text()
    assert text.startswith("In the beginning God created the heaven and the earth.")
    assert "Ge1:1" not in text[:1000]


def test_parse_methods_scales_baselines_to_the_budget():
    from bench.eval.common import parse_methods

    runs = parse_methods("full,retopk:tau=0.9+refresh_every=32,streaming_llm,loki", 64, 64)
    assert [r.label for r in runs] == ["full", "retopk tau=0.9 refresh_every=32", "streaming_llm", "loki"]
    assert dict(runs[1].spec.params) == {"top_k": 64, "tau": 0.9, "refresh_every": 32}
    assert dict(runs[2].spec.params) == {"top_k": 64, "sinks": 8}
    assert dict(runs[3].spec.params) == {"top_k": 64, "rank": 32}
    with pytest.raises(SystemExit):
        parse_methods("retopk,retopk", 64, 64)


# ---- shared prefill -------------------------------------------------------------------------------
def test_shared_prefill_equals_plain_prefill_for_every_method(tiny):
    from bench.eval.common import method_defaults, prefill_all
    from retopk_core.methods import method_names
    from retopk_server.runtime import MethodSpec, ModelRunner, RuntimeConfig

    runner = ModelRunner(RuntimeConfig(model=tiny[0]))
    ids = runner.encode(open(tiny[1]).read()[:3000], add_special_tokens=False)[:300]
    names = [n for n in method_names() if n != "fidelity_probe"]
    specs = [MethodSpec.of(n, **{**method_defaults(n, 16, 16), **({"cache_size": 8} if n == "retopk" else {})})
             for n in names]
    with torch.inference_mode():
        plain = [runner.open_session(s) for s in specs]
        shared = [runner.open_session(s) for s in specs]
        ref = prefill_all(runner, plain, ids[:250], share=False)
        got = prefill_all(runner, shared, ids[:250], share=True)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        for t in ids[250:260]:
            a, _ = runner.decode(plain, [t] * len(plain))
            b, _ = runner.decode(shared, [t] * len(shared))
            torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4, msg=lambda m: f"{names}: {m}")
