"""Constrained sampling (runtime/constraints.py + the Sampler) on the embedded model's tokenizer.

The logits are random (a seeded generator), so the grammar alone makes the text valid; each output is
checked by an independent reference: the ``jsonschema`` package, ``re.fullmatch``, the grammar's language.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from retopk_server.runtime.constraints import (  # noqa: E402
    ConstraintCompiler,
    ConstraintError,
    ConstraintLimits,
    ConstraintSpec,
    RowConstraint,
)
from retopk_server.runtime.sampling import Sampler, SamplingParams  # noqa: E402

EOS = 2  # SmolLM2's <|im_end|>
VOCAB = 49152

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from retopk_core.models import DEFAULT_MODEL, resolve_model

    source = resolve_model(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = ConstraintCompiler(tokenizer, VOCAB, [EOS])
    yield compiler
    compiler.close()


def run(compiler, tokenizer, spec: ConstraintSpec, seed: int, temperature: float = 1.0, steps: int = 120) -> str:
    """Sample from random logits under the constraint until it ends (EOS) -> the text."""
    constraint = RowConstraint.of(compiler.compile(spec), VOCAB)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=seed), constraint=constraint)
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(VOCAB, generator=g) * 3
        logits[EOS] += 4.0  # the model would end a finished value; random logits need the nudge
        before = logits.clone()
        token = sampler.sample(logits, out, [])
        assert torch.equal(logits, before)  # the caller's logits (a batch's row) are never masked in place
        if token == EOS:
            assert constraint.terminated
            break
        out.append(token)
    else:
        pytest.fail(f"no end after {steps} tokens: {tokenizer.decode(out)!r}")
    return tokenizer.decode(out)


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
     "required": ["name", "ok", "color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer",
                                                                                        "minimum": -5, "maximum": 5},
                                                                                  "y": {"type": "null"}},
                                                "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
def test_sampled_json_validates_against_its_schema(compiler, tokenizer, schema, seed):
    spec = ConstraintSpec("json_schema", json.dumps(SCHEMAS[schema]), strict=True)
    text = run(compiler, tokenizer, spec, seed)
    jsonschema.validate(json.loads(text), SCHEMAS[schema])


def test_json_object_allows_an_object_and_forbids_the_rest(compiler, tokenizer):
    """Greedy, with a model that prefers a line break at every step over the tokens of a JSON object: the mask
    refuses it every time (no raw line break inside a string, no free whitespace) and lets the object
    through, then only the end."""
    constraint = RowConstraint.of(compiler.compile(ConstraintSpec("json_object")), VOCAB)
    sampler = Sampler(SamplingParams(temperature=0.0), constraint=constraint)
    (bad,) = tokenizer.encode("\n", add_special_tokens=False)
    want = tokenizer.encode('{"a": [1, 2], "b": {"c": null}}', add_special_tokens=False) + [EOS]
    got: list[int] = []
    for t in want:
        logits = torch.zeros(VOCAB)
        logits[t], logits[bad] = 10.0, 20.0
        got.append(sampler.sample(logits, got, []))
    assert got == want and constraint.terminated
    assert isinstance(json.loads(tokenizer.decode(got[:-1])), dict)


def test_regex_and_grammar(compiler, tokenizer):
    for seed in range(3):
        text = run(compiler, tokenizer, ConstraintSpec("regex", r"[a-c]{2,5}-[0-9]{1,3}"), seed)
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{1,3}", text), text
        text = run(compiler, tokenizer, ConstraintSpec("grammar", 'root ::= "yes" | "no" | "maybe " [0-9]'), seed)
        assert text in ("yes", "no") or re.fullmatch(r"maybe [0-9]", text), text


def test_greedy_under_a_constraint_takes_the_best_allowed_token(compiler, tokenizer):
    constraint = RowConstraint.of(compiler.compile(ConstraintSpec("regex", "[0-9]+")), VOCAB)
    logits = torch.zeros(VOCAB)
    logits[100] = 50.0  # the unconstrained argmax, not a digit
    sampler = Sampler(SamplingParams(temperature=0.0), logprobs=3, constraint=constraint)
    token = sampler.sample(logits, [], [])
    assert token != 100 and tokenizer.decode([token]).isdigit()
    logprob, top = sampler.last_logprobs
    assert all(lp > float("-inf") for _, lp in top)  # forbidden tokens are no alternatives


def test_compiled_grammars_are_cached_by_content(compiler):
    a = compiler.compile(ConstraintSpec("regex", "x+"))
    assert compiler.compile(ConstraintSpec("regex", "x+")) is a
    assert compiler.compile(ConstraintSpec("regex", "y+")) is not a
    schema = json.dumps({"type": "object"})
    assert compiler.compile(ConstraintSpec("json_schema", schema, strict=True)) is not \
        compiler.compile(ConstraintSpec("json_schema", schema, strict=False))


@pytest.mark.parametrize(("spec", "field", "why"), [
    (ConstraintSpec("json_schema", "{"), "constraint.json_schema", "not valid JSON"),
    (ConstraintSpec("json_schema", "[1]"), "constraint.json_schema", "a JSON schema is an object"),
    (ConstraintSpec("json_schema", '{"type": "nonsense"}'), "constraint.json_schema", "cannot be compiled"),
    (ConstraintSpec("json_schema", '{"$ref": "#/nowhere"}'), "constraint.json_schema", "cannot be compiled"),
    (ConstraintSpec("grammar", "root ::= ("), "constraint.grammar", "cannot be compiled"),
    (ConstraintSpec("grammar", 'start ::= "x"'), "constraint.grammar", "cannot be compiled"),
    (ConstraintSpec("regex", "("), "constraint.regex", "cannot be compiled"),
    (ConstraintSpec("regex", ""), "constraint.regex", "must not be empty"),
    (ConstraintSpec("json_schema", "x" * 70000), "constraint.json_schema", "too long"),
    (ConstraintSpec("json_schema", '{"items": ' * 40 + "{}" + "}" * 40), "constraint.json_schema",
     "nested too deeply"),
])
def test_a_bad_constraint_is_the_clients_error_naming_the_field(compiler, spec, field, why):
    with pytest.raises(ConstraintError) as e:
        compiler.compile(spec)
    assert e.value.field == field and why in e.value.message
    with pytest.raises(ConstraintError):  # refusals are not cached as successes
        compiler.compile(spec)


def test_a_compilation_past_the_time_limit_is_refused(tokenizer):
    slow = ConstraintCompiler(tokenizer, VOCAB, [EOS], ConstraintLimits(compile_timeout_s=1e-6))
    try:
        schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "(a|b){50}"}
                                                              for i in range(30)}})
        with pytest.raises(ConstraintError, match="did not compile within"):
            slow.compile(ConstraintSpec("json_schema", schema))
    finally:
        slow.close()
