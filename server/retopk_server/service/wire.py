"""Wire messages <-> engine objects, with the input checks that need no model.

Every check raises ``InvalidArgument(field, message)``; the gateway's CallError answers INVALID_ARGUMENT
(HTTP 400) with "<field>: <message>". Checks that need the tokenizer (prompt length) run in the engine.
"""

from __future__ import annotations

import json
import math
import re
import uuid

from retopk_core.methods.registry import serving_method_names
from retopk_core.params import ParamError
from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.engine.commands import EngineStatus
from retopk_server.engine.requests import (
    MAX_N,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    TOOL_CHOICES,
    EngineError,
    FinishReason,
    GenerationRequest,
    TokenEvent,
)
from retopk_server.engine.session_table import SessionSnapshot
from retopk_server.engine.tools import forced_schema
from retopk_server.runtime.constraints import ConstraintLimits, ConstraintSpec, json_depth, parse_schema
from retopk_server.runtime.method_limits import check_method
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.prefix_cache import MAX_CACHE_SALT_CHARS
from retopk_server.runtime.sampling import SamplingParams
from retopk_server.runtime.sampling_defaults import resolve, resolved_fields
from retopk_server.runtime.vocab import first_bad_token, not_a_token

ROLES = ("system", "user", "assistant", "tool")
MAX_ID_CHARS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_STOP = 16
# Read from the proto's descriptors (the wire contract is their one definition): AttentionMethod's named
# hyperparameters in proto order (ReTopK's K, C, W, R, tau, T_r; each a ReTopKConfig field) and the sampling fields.
NAMED_PARAMS = tuple(f.name for f in pb.AttentionMethod.DESCRIPTOR.fields if f.name not in ("name", "params"))
SAMPLING_FIELDS = tuple(f.name for f in pb.SamplingParameters.DESCRIPTOR.fields)


MAX_MESSAGE_CHARS = EngineError.MAX_CHARS  # a status message at most


class InvalidArgument(ValueError):
    """``"<field>: <message>"``; a message that starts with the field's own name (a ParamError's "top_k must
    be ...") is not made to repeat it ("method.top_k: must be ...", not "method.top_k: top_k must be ...")."""

    def __init__(self, field: str, message: str) -> None:
        message = without_name(field, message)
        text = f"{_short(field, 120)}: {message}"
        super().__init__(text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "...")
        self.field = field


def without_name(field: str, message: str) -> str:
    """``message`` without a leading repetition of ``field``'s name ("sampling.temperature", "temperature must
    ..." -> "must ..."; "method.params['sink']", "sink must ..." -> "must ...")."""
    last = field.rsplit(".", 1)[-1]
    names = {field, last, last.partition("[")[0], last.partition("['")[2].rstrip("']")} - {""}
    for name in sorted(names, key=len, reverse=True):
        if message.startswith(name + " ") or message.startswith(name + ": "):
            return message[len(name):].lstrip(": ")
    return message


def check_range(field: str, value: int, low: int, high: int) -> int:
    """INVALID_ARGUMENT unless ``low <= value <= high``, worded the one way every range of a request is."""
    if not low <= value <= high:
        raise InvalidArgument(field, range_message(value, low, high))
    return value


def range_message(value, low, high) -> str:
    return f"must lie in [{low}, {high}], got {value}"


def _short(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters: messages quote what a client sent, which may be huge."""
    return text if len(text) <= limit else text[:limit] + "..."


def _float32(value: float) -> float:
    """A proto float as the decimal the caller most likely wrote (0.85f -> 0.85, not 0.8500000238)."""
    return value if math.isnan(value) or math.isinf(value) else float(f"{value:.7g}")


# A session id: what a URL path segment, a log line, a metadata value and a routers' hash key all take as it is.
SESSION_ID = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:@-]{{0,{MAX_ID_CHARS - 1}}}")
SESSION_ID_RULE = (f"1-{MAX_ID_CHARS} characters of letters, digits and _ . : @ -, starting with a letter or a "
                   "digit")


def identifier(field: str, value: str) -> str:
    if not value:
        raise InvalidArgument(field, "must not be empty when set")
    if field == "session_id" and not SESSION_ID.fullmatch(value):
        raise InvalidArgument(field, f"must be {SESSION_ID_RULE}, got {_short(value)!r}")
    if len(value) > MAX_ID_CHARS or not value.isprintable():
        raise InvalidArgument(field, f"must be at most {MAX_ID_CHARS} printable characters")
    return value


# ---------------------------------------------------------------------------------------------- method
def _param_value(key: str, value: pb.ParamValue):
    kind = value.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"method.params[{key!r}]", "no value set")
    return getattr(value, kind)


def method_spec(message: pb.AttentionMethod, default: MethodSpec, info=None) -> MethodSpec:
    """The MethodSpec a request or session asks for, checked by building it once: its name and hyperparameters,
    and with the model's ``info`` (a ModelInfo) its bounds against the model too (runtime/method_limits.py:
    context-bounded fields, state size).

    Empty name or the default's name: absent fields take the default's values; any other method
    starts from its own defaults.
    """
    name = message.name or default.name
    if name not in (names := serving_method_names()):  # evaluation wrappers are not a client's to pick
        raise InvalidArgument("method.name", f"unknown method {_short(name)!r}; choose one of {', '.join(names)}")
    params = dict(default.params) if name == default.name else {}
    given = {}
    for key in NAMED_PARAMS:
        if message.HasField(key):
            value = getattr(message, key)
            given[key] = _float32(value) if isinstance(value, float) else value
    for key, value in message.params.items():
        if key in given:
            raise InvalidArgument(f"method.params[{key!r}]", "also set as a named field of method")
        if not key.isidentifier():
            raise InvalidArgument(f"method.params[{key!r}]", "not a hyperparameter name")
        given[key] = _param_value(key, value)
    params.update(given)
    try:
        spec = MethodSpec(name, tuple(params.items()))
        if info is None:
            spec.build()
        else:
            check_method(spec, info)
    except ParamError as e:  # names the hyperparameter: a named field of method, or one of its params
        raise InvalidArgument(f"method.{method_field(e)}", str(e)) from None
    except ValueError as e:
        raise InvalidArgument("method", str(e)) from None
    return spec


def method_field(e: ParamError) -> str:
    """The AttentionMethod field a ParamError names: a named field ("cache_size") or "params['key']"."""
    return e.field if e.field == "name" or e.field in NAMED_PARAMS else f"params[{_short(e.field)!r}]"


def method_message(name: str, params: dict) -> pb.AttentionMethod:
    """An AttentionMethod message from a method name and its (resolved) hyperparameters."""
    message = pb.AttentionMethod(name=name)
    for key, value in params.items():
        if key in NAMED_PARAMS and isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(message, key, value)
        elif isinstance(value, bool):
            message.params[key].bool_value = value
        elif isinstance(value, int):
            message.params[key].int_value = value
        elif isinstance(value, float):
            message.params[key].float_value = value
        elif value is not None:
            message.params[key].string_value = str(value)
    return message


# ---------------------------------------------------------------------------------------------- generate
def sampling_params(message: pb.SamplingParameters, defaults=()) -> SamplingParams:
    """The fields the message sets over ``defaults`` (the model's, ModelInfo.sampling_defaults)."""
    values = {}
    for key in SAMPLING_FIELDS:
        if message.HasField(key):
            value = getattr(message, key)
            values[key] = _float32(value) if isinstance(value, float) else value
    try:
        return resolve(values, defaults)
    except ParamError as e:
        raise InvalidArgument(f"sampling.{e.field}", str(e)) from None


def sampling_message(defaults) -> pb.SamplingParameters:
    """ModelInfo.default_sampling: every field but seed as an unset request gets it."""
    return pb.SamplingParameters(**resolved_fields(defaults))


def chat_messages(message: pb.ChatMessages, field: str = "chat") -> list[dict]:
    """The messages as the chat template reads them; an assistant's tool calls and a tool result's
    ``tool_call_id`` / ``name`` only where set."""
    if not message.messages:
        raise InvalidArgument(field, "must hold at least one message")
    out = []
    for i, m in enumerate(message.messages):
        where = f"{field}.messages[{i}]"
        if m.role not in ROLES:
            raise InvalidArgument(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {_short(m.role)!r}")
        entry = {"role": m.role, "content": m.content}
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidArgument(f"{where}.tool_calls", "only an assistant message makes tool calls")
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": _tool_name(f"{where}.tool_calls[{j}].name", c.name),
                                                 "arguments": c.arguments}}
                                   for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id or m.name:
            if m.role != "tool":
                raise InvalidArgument(f"{where}.tool_call_id", "only a tool message answers a tool call")
            entry["tool_call_id"], entry["name"] = m.tool_call_id, m.name
        out.append(entry)
    return out


# ---------------------------------------------------------------------------------------------- constraints, tools
def _tool_name(field: str, name: str) -> str:
    if not TOOL_NAME.match(name):
        raise InvalidArgument(field, f"a function name is 1-64 letters, digits, '_' or '-', got {_short(name)!r}")
    return name


def constraint_spec(message: pb.Constraint, limits: ConstraintLimits, field: str = "constraint") -> ConstraintSpec:
    """The ConstraintSpec a Constraint message asks for, checked for size and (JSON schemas) nesting."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(field, "set one of json_schema, json_object, regex, grammar")
    if message.strict and kind != "json_schema":
        raise InvalidArgument(f"{field}.strict", "applies to json_schema only")
    text = "" if kind == "json_object" else getattr(message, kind)
    spec = ConstraintSpec(kind, text, message.strict, f"{field}.{kind}")
    try:
        spec.check(limits)
    except ValueError as e:
        raise InvalidArgument(e.field, e.message) from None
    return spec


def tool_list(tools, limits: ConstraintLimits) -> list[dict]:
    """Tool messages -> OpenAI-style tool dicts, each name unique and each schema a bounded JSON object."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out, seen = [], set()
    for i, t in enumerate(tools):
        name = _tool_name(f"tools[{i}].name", t.name)
        if name in seen:
            raise InvalidArgument(f"tools[{i}].name", f"{name!r} is named twice")
        seen.add(name)
        fn = {"name": name, "description": t.description}
        if t.parameters_json:
            where = f"tools[{i}].parameters_json"
            if len(t.parameters_json) > limits.max_chars:
                raise InvalidArgument(where, f"too long: {len(t.parameters_json)} characters, the limit is "
                                             f"{limits.max_chars} (ModelInfo.limits.max_constraint_chars)")
            try:
                schema = parse_schema(where, t.parameters_json)
            except ValueError as e:
                raise InvalidArgument(e.field, e.message) from None
            if not isinstance(schema, dict):
                raise InvalidArgument(where, "must be a JSON object (a schema of the arguments object)")
            if json_depth(schema, limits.max_depth + 1) > limits.max_depth:
                raise InvalidArgument(where, f"nested too deeply: more than {limits.max_depth} levels "
                                             "(ModelInfo.limits.max_constraint_depth)")
            fn["parameters"] = schema
        else:
            fn["parameters"] = {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def _tools(message: pb.GenerateRequest, spec: GenerationRequest, limits: ConstraintLimits) -> None:
    """tools and tool_choice onto ``spec``; a forced call (required / a function) becomes its constraint."""
    has_choice = message.HasField("tool_choice")
    if not message.tools:
        if has_choice and message.tool_choice.WhichOneof("choice") is not None and not (
                message.tool_choice.WhichOneof("choice") == "mode" and message.tool_choice.mode == "none"):
            raise InvalidArgument("tool_choice", "needs tools")
        return
    if spec.chat is None:
        raise InvalidArgument("tools", "need chat input (the tools are rendered by the chat template)")
    spec.tools = tool_list(message.tools, limits)
    which = message.tool_choice.WhichOneof("choice") if has_choice else None
    if which == "mode":
        if message.tool_choice.mode not in TOOL_CHOICES:
            raise InvalidArgument("tool_choice.mode", f"must be one of {', '.join(TOOL_CHOICES)}, got "
                                                      f"{_short(message.tool_choice.mode)!r}")
        spec.tool_choice = message.tool_choice.mode
    elif which == "function":
        name = message.tool_choice.function
        if name not in [t["function"]["name"] for t in spec.tools]:
            raise InvalidArgument("tool_choice.function", f"{_short(name)!r} is none of the request's tools")
        spec.tool_choice, spec.tool_function = "function", name
    if spec.tool_choice in ("required", "function"):
        if spec.constraint is not None:
            raise InvalidArgument("constraint", f"must be absent with tool_choice {spec.tool_choice!r} (the "
                                                "call's schema constrains the output)")
        spec.constraint = ConstraintSpec("json_schema", forced_schema(spec.tools, spec.tool_function),
                                         field="tools")


def tool_constraints(spec: GenerationRequest) -> list[ConstraintSpec]:
    """Each tool's arguments schema as a constraint of its own (to name the one that does not compile)."""
    return [ConstraintSpec("json_schema", json.dumps(t["function"]["parameters"]), field=f"tools[{i}].parameters_json")
            for i, t in enumerate(spec.tools or ())]




def check_token_ids(field: str, ids, vocab_size: int) -> list[int]:
    ids = list(ids)
    if (i := first_bad_token(ids, vocab_size)) is not None:
        raise InvalidArgument(f"{field}[{i}]", not_a_token(ids, i, vocab_size))
    return ids


def generation_request(message: pb.GenerateRequest, info, max_new_tokens_limit: int, deadline: float | None,
                       constraint_limits: ConstraintLimits | None = None) -> GenerationRequest:
    """Check a GenerateRequest against the model ``info`` (a ModelInfo: its vocabulary, default method and sampling
    defaults, which unset sampling fields take) and turn it into the engine's GenerationRequest: every field is
    checked here (the constraint for size; the gateway compiles it), and the engine only asserts what this
    establishes (GenerationRequest.assert_checked). What needs the tokenizer or the session (the prompt's length,
    the chat template) is the engine's to refuse."""
    vocab_size = info.vocab_size
    constraint_limits = constraint_limits or ConstraintLimits()
    request_id = (identifier("request_id", message.request_id) if message.HasField("request_id")
                  else uuid.uuid4().hex)
    spec = GenerationRequest(request_id=request_id, deadline=deadline)
    which = message.WhichOneof("input")
    if which is None:
        raise InvalidArgument("input", "set one of text, token_ids, chat")
    if which == "text":
        if not message.text:
            raise InvalidArgument("text", "must not be empty")
        spec.text = message.text
    elif which == "token_ids":
        if not message.token_ids.ids:
            raise InvalidArgument("token_ids", "must not be empty")
        spec.token_ids = check_token_ids("token_ids", message.token_ids.ids, vocab_size)
    else:
        spec.chat = chat_messages(message.chat)
    if message.chat_history and spec.chat is None:
        raise InvalidArgument("chat_history", "needs chat input (the conversation's messages)")
    spec.chat_history = message.chat_history
    if message.HasField("session_id"):
        spec.session_id = identifier("session_id", message.session_id)
        if message.HasField("method"):
            raise InvalidArgument("method", "must be absent when session_id is set (a session keeps its own method)")
    elif message.HasField("method"):
        spec.method = method_spec(message.method, info.default_method, info)
    spec.sampling = sampling_params(message.sampling, info.sampling_defaults)
    if message.HasField("max_new_tokens"):
        spec.max_new_tokens = check_range("max_new_tokens", message.max_new_tokens, 1, max_new_tokens_limit)
    if len(message.stop) > MAX_STOP:
        raise InvalidArgument("stop", f"at most {MAX_STOP} stop strings, got {len(message.stop)}")
    for i, s in enumerate(message.stop):
        if not s:
            raise InvalidArgument(f"stop[{i}]", "must not be empty")
    spec.stop = list(message.stop)
    spec.stop_token_ids = check_token_ids("stop_token_ids", message.stop_token_ids, vocab_size)
    spec.ignore_eos = message.ignore_eos
    spec.return_step_stats = message.return_step_stats
    spec.logprobs = message.logprobs
    spec.top_logprobs = check_range("top_logprobs", message.top_logprobs, 0, MAX_TOP_LOGPROBS)
    if spec.top_logprobs and not spec.logprobs:
        raise InvalidArgument("top_logprobs", "needs logprobs to be set")
    if message.HasField("constraint"):
        spec.constraint = constraint_spec(message.constraint, constraint_limits)
    _tools(message, spec, constraint_limits)
    if message.HasField("n") and message.n != 0:
        if not 1 <= message.n <= MAX_N:
            raise InvalidArgument("n", f"must lie in [1, {MAX_N}], got {message.n}")
        if message.n > 1 and spec.session_id is not None:
            raise InvalidArgument("n", "must be 1 with session_id (a session continues one conversation)")
        spec.n = message.n
    if message.HasField("cache_salt"):
        if len(message.cache_salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidArgument("cache_salt", f"must be at most {MAX_CACHE_SALT_CHARS} characters, got "
                                                f"{len(message.cache_salt)}")
        spec.cache_salt = message.cache_salt
    return spec


def step_stats_message(stats, token_index: int) -> pb.StepStats:
    """A runtime StepStats as the wire message: (layers, heads) and (layers, H_kv) arrays flattened row-major."""
    layers, heads = stats.path.shape
    return pb.StepStats(token_index=token_index, num_layers=layers, num_heads=heads,
                        path=stats.path.reshape(-1).to(dtype=stats.n_scored.dtype).tolist(),
                        max_sim=stats.max_sim.reshape(-1).tolist(), n_scored=stats.n_scored.reshape(-1).tolist(),
                        attention_seconds=float(stats.attention_s), num_kv_heads=stats.num_kv_heads,
                        group_read=stats.group_read.reshape(-1).tolist())


def generate_response(event: TokenEvent, request_id: str) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=request_id, token_ids=event.token_ids, text=event.text,
                              session_id=event.session_id, index=event.index)
    for call in event.tool_calls or ():
        out.tool_calls.append(pb.ToolCall(index=call.index, id=call.id, name=call.name, arguments=call.arguments))
    if event.step_stats is not None:
        out.step_stats.append(step_stats_message(event.step_stats, event.token_index))
    for lp in event.logprobs or ():
        out.logprobs.append(pb.TokenLogprob(
            token_id=lp.token_id, logprob=lp.logprob, token=lp.token,
            top=[pb.TopLogprob(token_id=t, logprob=v, token=s)
                 for (t, v), s in zip(lp.top, lp.top_tokens or ("",) * len(lp.top), strict=True)]))
    if event.finish_reason is not None:
        out.finish_reason = _FINISH[event.finish_reason]
        u, t = event.usage, event.timings
        out.usage.CopyFrom(pb.Usage(prompt_tokens=u.prompt_tokens, generated_tokens=u.generated_tokens,
                                    session_tokens=u.session_tokens, cached_prompt_tokens=u.cached_tokens))
        out.timings.CopyFrom(pb.Timings(queue_seconds=t.queue_s, prefill_seconds=t.prefill_s,
                                        time_to_first_token_seconds=t.time_to_first_token_s,
                                        decode_seconds=t.decode_s, total_seconds=t.total_s))
    return out


_FINISH = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS_TOKEN: pb.FINISH_REASON_EOS_TOKEN,
    FinishReason.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN,
    FinishReason.STOP_SEQUENCE: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CONTEXT_LENGTH: pb.FINISH_REASON_CONTEXT_LENGTH,
    FinishReason.TOOL_CALLS: pb.FINISH_REASON_TOOL_CALLS,
}


# ---------------------------------------------------------------------------------------------- others
def session_info(s: SessionSnapshot) -> pb.SessionInfo:
    return pb.SessionInfo(session_id=s.session_id, method=method_message(s.method.name, s.method_params),
                          num_tokens=s.num_tokens, kv_bytes=s.kv_bytes, method_state_bytes=s.method_state_bytes,
                          busy=s.busy, turns=s.turns, created_unix=s.created_unix, last_used_unix=s.last_used_unix)


def server_status(s: EngineStatus) -> pb.ServerStatus:
    return pb.ServerStatus(running=s.running, queued=s.queued, sessions=s.sessions,
                           ephemeral_sessions=s.ephemeral_sessions, draining=s.draining, kv_bytes=s.kv_bytes,
                           method_state_bytes=s.method_state_bytes, cache_budget_bytes=s.cache_budget_bytes,
                           cache_reserved_bytes=s.cache_reserved_bytes, sessions_evicted=s.sessions_evicted)
