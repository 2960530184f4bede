"""n > 1, tools and constraint checks through the gRPC service over the fake runner (fast, no model), and the
tool-call parsers against the JSON they must reproduce.

The fake model is deterministic (``fake_runner.greedy_reference``), so every greedy choice of an n > 1
request must be exactly what the same request alone produces.
"""

from __future__ import annotations

import json

import grpc
import pytest

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.engine.tools import AutoParser, ForcedParser, forced_schema
from tests.server.fake_runner import FakeRunner, greedy_reference

pytestmark = pytest.mark.timeout(60)

USER = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
GREEDY = pb.SamplingParameters(temperature=0)


def enc(text: str) -> list[int]:
    return [ord(c) for c in text]


def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        list(call())
    return info.value.code(), info.value.details()


# --- n > 1 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_running", [16, 2])  # room for all choices, and fewer rows than choices
def test_n_choices_from_one_prefill_each_as_the_request_alone(fake_server, max_running):
    runner = FakeRunner()
    server = fake_server(runner, max_running=max_running)
    out = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=6, n=3, sampling=GREEDY)))
    expected = greedy_reference(enc("hello"), 6)
    assert {r.index for r in out} == {0, 1, 2}
    for i in range(3):
        mine = [r for r in out if r.index == i]
        assert [t for r in mine for t in r.token_ids] == expected
        assert [bool(r.finish_reason) for r in mine] == [False] * (len(mine) - 1) + [True]
        assert (mine[-1].usage.prompt_tokens, mine[-1].usage.generated_tokens) == (5, 6)
    assert sum(1 for kind, _ in runner.log if kind == "prefill") == 1  # one prefill for the three choices
    assert max(runner.batch_sizes) == 3  # the choices decode together
    assert not runner.sessions  # every fork closed with its choice


def test_n_choices_with_a_seed_draw_differently(fake_server):
    # top_p 1, temperature 5: the fake's one likely token (logit 10) is no longer near-certain
    sampling = pb.SamplingParameters(temperature=5.0, top_p=1.0, seed=7)
    server = fake_server()
    out = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=12, n=4, sampling=sampling,
                                                       ignore_eos=True)))
    texts = ["".join(r.text for r in out if r.index == i) for i in range(4)]
    assert len(set(texts)) > 1
    again = list(server.stub.Generate(pb.GenerateRequest(text="hello", max_new_tokens=12, n=4, sampling=sampling,
                                                         ignore_eos=True)))
    assert ["".join(r.text for r in again if r.index == i) for i in range(4)] == texts  # seed, seed + 1, ...


def test_n_is_bounded_and_refused_with_a_session(fake_server):
    server = fake_server()
    code, details = refused(lambda: server.stub.Generate(pb.GenerateRequest(text="x", n=17)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("n:")
    server.stub.CreateSession(pb.CreateSessionRequest(session_id="s"))
    code, details = refused(lambda: server.stub.Generate(pb.GenerateRequest(text="x", n=2, session_id="s")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("n:")
    limits = server.stub.GetModelInfo(pb.GetModelInfoRequest()).limits
    assert (limits.max_n, limits.max_tools) == (16, 64)
    assert limits.max_constraint_chars > 0 and limits.max_constraint_depth > 0
    assert limits.constraint_compile_timeout_ms > 0


# --- tools and constraints: checks that need no compiler ----------------------------------------------------
TOOL = pb.Tool(name="get_weather", description="weather", parameters_json=json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))


@pytest.mark.parametrize(("request_", "field"), [
    (pb.GenerateRequest(text="x", tools=[TOOL]), "tools"),
    (pb.GenerateRequest(chat=USER, tool_choice=pb.ToolChoice(mode="required")), "tool_choice"),
    (pb.GenerateRequest(chat=USER, tools=[TOOL], tool_choice=pb.ToolChoice(mode="sometimes")), "tool_choice.mode"),
    (pb.GenerateRequest(chat=USER, tools=[TOOL], tool_choice=pb.ToolChoice(function="nope")),
     "tool_choice.function"),
    (pb.GenerateRequest(chat=USER, tools=[TOOL, TOOL]), "tools[1].name"),
    (pb.GenerateRequest(chat=USER, tools=[pb.Tool(name="bad name")]), "tools[0].name"),
    (pb.GenerateRequest(chat=USER, tools=[pb.Tool(name="f", parameters_json="{")]), "tools[0].parameters_json"),
    (pb.GenerateRequest(chat=USER, tools=[pb.Tool(name="f", parameters_json="[]")]), "tools[0].parameters_json"),
    (pb.GenerateRequest(chat=USER, tools=[pb.Tool(name="f", parameters_json='{"items": ' * 40 + "{}" + "}" * 40)]),
     "tools[0].parameters_json"),
    (pb.GenerateRequest(chat=USER, tools=[pb.Tool(name=f"f{i}") for i in range(65)]), "tools"),
    (pb.GenerateRequest(chat=USER, tools=[TOOL], tool_choice=pb.ToolChoice(mode="required"),
                        constraint=pb.Constraint(json_object=True)), "constraint"),
    (pb.GenerateRequest(text="x", constraint=pb.Constraint()), "constraint"),
    (pb.GenerateRequest(text="x", constraint=pb.Constraint(regex="a+", strict=True)), "constraint.strict"),
    (pb.GenerateRequest(text="x", constraint=pb.Constraint(json_schema="{")), "constraint.json_schema"),
    (pb.GenerateRequest(text="x", constraint=pb.Constraint(json_schema="x" * 70000)), "constraint.json_schema"),
    (pb.GenerateRequest(text="x", constraint=pb.Constraint(grammar="")), "constraint.grammar"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(
        role="user", content="x", tool_calls=[pb.ToolCall(name="f")])])), "chat.messages[0].tool_calls"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(
        role="user", content="x", tool_call_id="c1")])), "chat.messages[0].tool_call_id"),
])
def test_bad_tools_and_constraints_are_invalid_argument_naming_the_field(fake_server, request_, field):
    server = fake_server()
    code, details = refused(lambda: server.stub.Generate(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), details
    assert server.engine.alive


def test_a_tokenizer_the_compiler_cannot_read_is_no_internal_error(fake_server):
    server = fake_server()
    code, details = refused(lambda: server.stub.Generate(pb.GenerateRequest(
        text="x", constraint=pb.Constraint(regex="a+"))))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith("constraint:")


def test_tool_messages_reach_the_template(fake_server):
    runner = FakeRunner()
    server = fake_server(runner)
    chat = pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="weather?"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather", arguments="{}")]),
        pb.ChatMessage(role="tool", content="sunny", tool_call_id="c1", name="get_weather")])
    out = list(server.stub.Generate(pb.GenerateRequest(chat=chat, tools=[TOOL], tool_choice=pb.ToolChoice(
        mode="none"), max_new_tokens=3, sampling=GREEDY)))
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and not any(r.tool_calls for r in out)


# --- parsers -----------------------------------------------------------------------------------------------
def pieces_of(parser, text: str, step: int):
    content, calls = [], []
    for i in range(0, len(text), step):
        c, p = parser.feed(text[i:i + step])
        content.append(c)
        calls += p
    c, p = parser.finish()
    return "".join(content) + c, calls + p


@pytest.mark.parametrize("step", [1, 3, 7, 1000])  # how the text arrives: a character at a time .. at once
def test_forced_call_streams_the_arguments_exactly(step):
    arguments = {"city": "Paris \"center\"", "days": [1, 2], "nested": {"a": None}}
    text = json.dumps({"name": "get_weather", "arguments": arguments})
    content, calls = pieces_of(ForcedParser(), text, step)
    assert content == "" and calls[0].name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads("".join(c.arguments for c in calls)) == arguments
    assert {c.index for c in calls} == {0}


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_auto_calls_are_cut_out_of_the_text(step):
    a, b = {"city": "Oslo"}, {"q": "x < y"}
    text = (f'Let me check. <tool_call>\n{json.dumps({"name": "get_weather", "arguments": a})}\n</tool_call>'
            f'<tool_call>{json.dumps({"name": "search", "arguments": b})}</tool_call> and <tool_call>not json'
            "</tool_call> <tool")
    content, calls = pieces_of(AutoParser(), text, step)
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [(0, "get_weather", a), (1, "search", b)]
    assert content == "Let me check.  and <tool_call>not json</tool_call> <tool"


def test_forced_schema_accepts_exactly_the_calls_of_the_chosen_tools():
    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}}, {"type": "function", "function": {"name": "b"}}]
    any_tool, only_a = json.loads(forced_schema(tools)), json.loads(forced_schema(tools, "a"))
    jsonschema.validate({"name": "a", "arguments": {"x": 1}}, any_tool)
    jsonschema.validate({"name": "b", "arguments": {}}, any_tool)
    jsonschema.validate({"name": "a", "arguments": {"x": 1}}, only_a)
    for bad, schema in [({"name": "b", "arguments": {}}, only_a), ({"name": "a", "arguments": {"x": "1"}}, any_tool),
                        ({"name": "c", "arguments": {}}, any_tool)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
