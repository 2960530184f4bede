"""Structured output, tool calls and n > 1 on the live server (embedded model), through the official ``openai``
client and the gRPC SDK. Every JSON output is checked by the ``jsonschema`` package, not by the server's code.

(Named to run before test_raw_http.py, whose last test drains the shared server.)
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from retopk_client import Constraint, Tool

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.timeout(900)  # generous for a busy 2-core machine; short outputs keep it quick

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "country": {"type": "string", "maxLength": 12},
                                         "capital": {"type": "boolean"}},
        "required": ["city", "country", "capital"], "additionalProperties": False}
MOOD = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "neutral"]},
                                         "score": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["mood", "score"], "additionalProperties": False}
LIST = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                   "minItems": 1, "maxItems": 2}},
        "required": ["items"], "additionalProperties": False}
PROMPTS = [
    ("Describe a fictional person as JSON.", PERSON), ("Who wrote Hamlet? Answer as JSON.", PERSON),
    ("Give the oldest person you know of as JSON.", PERSON), ("Invent a character for a story.", PERSON),
    ("A famous scientist, as JSON.", PERSON), ("Tell me about Paris.", CITY), ("Tell me about Tokyo.", CITY),
    ("Name a city in Brazil.", CITY), ("Which city has the Colosseum?", CITY), ("A small town you like.", CITY),
    ("How does a rainy day feel?", MOOD), ("Rate your mood after winning a prize.", MOOD),
    ("How do you feel about Mondays?", MOOD), ("Classify: 'I lost my keys again'.", MOOD),
    ("Classify: 'What a lovely morning'.", MOOD), ("List some fruits.", LIST), ("List three colors.", LIST),
    ("What should I pack for a trip?", LIST), ("Name planets of the solar system.", LIST),
    ("Give me some programming languages.", LIST),
]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 30}},
                                               "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_json_schema_strict_outputs_validate(openai_client, model):
    assert len({p for p, _ in PROMPTS}) == 20
    for prompt, schema in PROMPTS:
        r = openai_client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=100, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (prompt, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_on_completions_and_regex_on_chat(openai_client, model):
    r = openai_client.completions.create(model=model, prompt="A JSON object describing a cat:", max_tokens=120,
                                         temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":  # a small model may fill a whole object's worth of string
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")
    r = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Pick a date."}],
                                              max_tokens=20, temperature=0.8, seed=3,
                                              extra_body={"retopk": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].message.content)


def test_named_tool_call_validates_streamed_and_not(openai_client, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = openai_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                              max_tokens=60, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    (call,) = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    stream = openai_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=60, temperature=0, stream=True)
    pieces, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            pieces += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(pieces) > 2  # streamed as deltas, not one piece
    assert pieces[0].id and pieces[0].function.name == "get_weather" and {p.index for p in pieces} == {0}
    arguments = "".join(p.function.arguments or "" for p in pieces)
    assert json.loads(arguments) == json.loads(call.function.arguments)  # greedy: the same call either way

    # the next turn carries the call and its result
    follow = openai_client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, tools=TOOLS,
        messages=ASK + [message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].message.role == "assistant"


def test_required_tool_choice_calls_one_of_the_tools(openai_client, model):
    r = openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Time in Oslo?"}],
                                              tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # tool_choice "none": text, no calls
    r = openai_client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none",
                                              max_tokens=6, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def prefills(http_server) -> float:
    text = httpx.get(http_server.metrics_url, timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("retopk_prefill_seconds_count"))


def test_n_choices_from_one_prefill_with_the_prompt_counted_once(openai_client, http_server, model):
    question = [{"role": "user", "content": "Say something about the sea."}]
    one = openai_client.chat.completions.create(model=model, messages=question, max_tokens=8, temperature=0)
    before = prefills(http_server)
    r = openai_client.chat.completions.create(model=model, messages=question, max_tokens=8, n=4, temperature=1.0,
                                              seed=11, logprobs=True)
    assert prefills(http_server) == before + 1
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    assert len({c.message.content for c in r.choices}) > 1  # four samples, not one repeated

    stream = openai_client.completions.create(model=model, prompt="The sea is", max_tokens=5, n=2, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    alone = openai_client.completions.create(model=model, prompt="The sea is", max_tokens=5, temperature=0)
    assert texts == {0: alone.choices[0].text, 1: alone.choices[0].text}  # greedy choices: the request alone
    assert usage.prompt_tokens == alone.usage.prompt_tokens
    assert usage.completion_tokens == 2 * alone.usage.completion_tokens


def test_bad_constraints_are_400_naming_the_field_and_the_server_stays_healthy(openai_client, http_server, model):
    deep = {"type": "object", "properties": {"a": {}}}
    node = deep["properties"]
    for _ in range(40):
        node["a"] = {"type": "object", "properties": {"a": {}}}
        node = node["a"]["properties"]
    cases = [
        ("response_format.json_schema.schema", dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}})),
        ("response_format.json_schema.schema", dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "description": "x" * 70000}}})),
        ("response_format.json_schema.schema", dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": deep}})),
        ("response_format.type", dict(response_format={"type": "yaml"})),
        ("retopk.grammar", dict(extra_body={"retopk": {"grammar": "root ::= ("}})),
        ("retopk.regex", dict(extra_body={"retopk": {"regex": "("}})),
        ("n", dict(n=17)),
        ("n", dict(n=0)),
        ("tool_choice.function.name", dict(tools=TOOLS, tool_choice={"type": "function",
                                                                     "function": {"name": "nope"}})),
        ("tools[0].function.parameters", dict(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "nonsense"}}}], tool_choice="required")),
        ("tools[1].function.name", dict(tools=[TOOLS[0], TOOLS[0]])),
    ]
    for param, kwargs in cases:
        with pytest.raises(openai.BadRequestError) as info:
            openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=2, **kwargs)
        body = info.value.body
        assert body["param"] == param and body["message"].startswith(param + ":"), (param, body)
    assert httpx.get(http_server.http_url + "/health", timeout=30).status_code == 200
    r = openai_client.chat.completions.create(model=model, messages=ASK, max_tokens=2)
    assert r.choices[0].finish_reason == "length"


def test_grpc_sdk_constraint_tools_and_n(grpc_client):
    out = grpc_client.complete(messages=ASK, max_new_tokens=60, temperature=0,
                               constraint=Constraint.json_schema(WEATHER, strict=True))
    assert out.finish_reason.value == "eos_token"
    jsonschema.validate(json.loads(out.text), WEATHER)
    out = grpc_client.complete(messages=ASK, max_new_tokens=60, temperature=0, tools=[Tool.coerce(t) for t in TOOLS],
                               tool_choice={"name": "get_weather"})
    assert out.finish_reason.value == "tool_calls" and out.text == ""
    (call,) = out.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with grpc_client.generate("The sea is", max_new_tokens=4, temperature=0, n=3) as stream:
        choices = stream.completions()
    assert [c.index for c in choices] == [0, 1, 2] and len({c.text for c in choices}) == 1
    assert all(c.usage.generated_tokens == 4 for c in choices)
    limits = grpc_client.model_info().limits
    assert limits.max_n == 16 and limits.max_constraint_chars >= 65536
