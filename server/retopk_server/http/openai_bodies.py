"""OpenAI request bodies -> the gRPC GenerateRequest they mean; GenerateResponses -> OpenAI response objects.

The HTTP front hands that GenerateRequest to the gateway the gRPC servicer calls too, so both fronts accept and
refuse the same values with the same limits, keys and metrics; a refusal's field is renamed back to the
body's (``field_renamer``: ``max_new_tokens`` -> ``max_tokens``, ``sampling.temperature`` ->
``temperature``, ``method.top_k`` -> ``retopk.method.top_k``). This module checks only what the gRPC
request cannot express: the body's shapes (``response_format``, ``tools``, ``tool_choice``, messages'
``tool_calls``) and values a proto field cannot hold.

finish_reason: max_tokens or the context length -> "length"; EOS, a stop token or a stop string -> "stop"
(the stop string itself is not part of the text, as in OpenAI's API); a reply that called tools ->
"tool_calls". With ``n`` > 1 the GenerateResponses of every choice arrive interleaved, each naming its
``index``; usage counts the prompt once and the completion tokens of every choice.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

from pydantic import ValidationError

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_server.engine.requests import MAX_TOP_LOGPROBS
from retopk_server.http.errors import ApiError
from retopk_server.http.schemas import ChatCompletionRequest, CompletionRequest
from retopk_server.service import wire
from retopk_shared.fields import FieldValueError, method_message, set_field, split_method

Body = CompletionRequest | ChatCompletionRequest

ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name of the system role
_OPENAI_SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed")
_RETOPK_SAMPLING = ("top_k", "min_p", "repetition_penalty")
_UNION_TAG = re.compile(r"^[A-Z]|[\[\]]|^(str|int|float|bool|list|dict|none)$")


# OpenAI fields this server does not implement, accepted only with the value that asks for nothing (what
# clients send by default); any other value is a 400 saying so. Every other unknown field is a 400 too.
_NEUTRAL = {"logit_bias": [None, {}], "functions": [None, []], "function_call": [None, "none", "auto"],
            "store": [None, False], "metadata": [None, {}], "service_tier": [None, "auto", "default"]}
_NEUTRAL_COMPLETIONS = {"echo": [None, False], "best_of": [None, 1], "suffix": [None, ""]}


def drop_neutral(body: dict, chat: bool) -> dict:
    """The body without the unimplemented OpenAI fields that hold their neutral value (see _NEUTRAL)."""
    neutral = _NEUTRAL if chat else {**_NEUTRAL, **_NEUTRAL_COMPLETIONS}
    out = {}
    for key, value in body.items():
        if key not in neutral:
            out[key] = value
        elif not any(type(value) is type(n) and value == n for n in neutral[key]):
            raise _bad(key, f"not supported by this server; only {' or '.join(map(repr, neutral[key]))} is accepted")
    return out


# ---------------------------------------------------------------------------------------------- errors
def _path(loc) -> str:
    """pydantic's error location as a field path: ("messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.search(part):  # drop the union member tags pydantic adds ("str", "list[str]")
            out += f".{part}" if out else part
    return out or "body"


def validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the first wrong field; the alternatives of a union are joined with "or"."""
    errors = exc.errors(include_url=False)
    param = _path(errors[0]["loc"])
    if errors[0]["type"] == "extra_forbidden":
        return ApiError("INVALID_ARGUMENT", f"{param}: unknown field (not supported by this server)", param)
    if errors[0]["type"] == "missing":
        return ApiError("INVALID_ARGUMENT", f"{param}: required", param)
    same = [e for e in errors if _path(e["loc"]) == param]
    why = " or ".join(dict.fromkeys(e["msg"][0].lower() + e["msg"][1:] for e in same))
    got = type(errors[0].get("input")).__name__.replace("NoneType", "null")
    return ApiError("INVALID_ARGUMENT", f"{param}: {why} (got {got})", param)


def field_renamer(body: Body) -> Callable[[str], str]:
    """GenerateRequest field path -> the HTTP body's name for it."""
    chat = isinstance(body, ChatCompletionRequest)
    max_name = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
    prefixes = [("sampling", lambda rest: rest[1:] if rest[1:] in _OPENAI_SAMPLING else f"retopk{rest}"),
                ("chat.messages", lambda rest: "messages" + rest), ("chat", lambda rest: "messages" + rest),
                ("text", lambda rest: "prompt" + rest), ("token_ids", lambda rest: "prompt" + rest),
                ("max_new_tokens", lambda rest: max_name + rest),
                ("method", lambda rest: "retopk.method" + _flat(rest)),
                ("session_id", lambda rest: "retopk.session_id" + rest),
                ("chat_history", lambda rest: "retopk.chat_history" + rest),
                ("stop_token_ids", lambda rest: "retopk.stop_token_ids" + rest),
                ("constraint.json_schema", lambda rest: "response_format.json_schema.schema"),
                ("constraint.regex", lambda rest: "retopk.regex"),
                ("constraint.grammar", lambda rest: "retopk.grammar"),
                ("constraint", lambda rest: "response_format"),
                ("tools.json_schema", lambda rest: "tools"),
                ("tool_choice.function", lambda rest: "tool_choice.function.name"),
                ("tool_choice.mode", lambda rest: "tool_choice"),
                ("tools", _tool_field),
                ("top_logprobs", lambda rest: ("top_logprobs" if chat else "logprobs") + rest)]

    def rename(field: str) -> str:
        for prefix, new in prefixes:
            if field == prefix or field.startswith(prefix) and field[len(prefix)] in ".[":
                return new(field[len(prefix):])
        return field

    return rename


def _flat(rest: str) -> str:
    """A method's hyperparameter as the body names it: ".params['sink']" -> ".sink" (the body's method object
    holds every hyperparameter by name; only the wire splits them into named fields and params)."""
    match = re.fullmatch(r"\.params\['([^']*)'\](.*)", rest)
    return f".{match.group(1)}{match.group(2)}" if match else rest


def _tool_field(rest: str) -> str:
    """"[2].parameters_json" -> "tools[2].function.parameters" (and .name, .description likewise)."""
    index, _, name = rest.partition("].")
    if not name:
        return "tools" + rest
    return f"tools{index}].function.{ {'parameters_json': 'parameters'}.get(name, name)}"


def _bad(param: str, why: str) -> ApiError:
    return ApiError("INVALID_ARGUMENT", f"{param}: {why}", param)


def _token_ids(param: str, ids: list, vocab_size: int) -> list[int]:
    try:
        return wire.check_token_ids(param, ids, vocab_size)
    except wire.InvalidArgument as e:
        raise _bad(e.field, str(e).removeprefix(e.field + ": ")) from None


def _set(message, name: str, value, param: str, bounds: tuple[int, int] | None = None) -> None:
    """Set a proto field; a value outside ``bounds`` (the gRPC front's own range of the field) or that its type
    cannot hold (a negative uint, an int past 64 bits) is the client's, worded as the gRPC front words a range."""
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        raise _bad(param, wire.range_message(value, *bounds))
    try:
        set_field(message, name, value, param)
    except FieldValueError as e:
        raise _bad(param, e.reason) from None


# ---------------------------------------------------------------------------------------------- inputs
def _prompt(body: CompletionRequest, message: pb.GenerateRequest, vocab_size: int) -> None:
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        message.text = prompt
        return
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        message.token_ids.ids.extend(_token_ids("prompt", prompt, vocab_size))
        return
    if isinstance(body.prompt, list) and len(body.prompt) > 1 and all(isinstance(p, (str, list)) for p in body.prompt):
        raise _bad("prompt", f"one prompt per request, got {len(body.prompt)}")
    raise _bad("prompt", "expected a string, a list of one string, a non-empty list of token ids or a list of "
                         "one such list")


def _content(i: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"messages[{i}].content[{j}]", 'only text parts {"type": "text", "text": "..."} are supported')
        if set(part) - {"type", "text"}:
            raise _bad(f"messages[{i}].content[{j}]", f"unknown keys {sorted(set(part) - {'type', 'text'})}")
        parts.append(part["text"])
    return "\n".join(parts)


def _messages(body: ChatCompletionRequest, message: pb.GenerateRequest) -> None:
    if not body.messages:
        raise _bad("messages", "must hold at least one message")
    for i, m in enumerate(body.messages):
        out = message.chat.messages.add(role=ROLE_ALIASES.get(m.role, m.role), content=_content(i, m.content))
        for j, call in enumerate(m.tool_calls or ()):
            where = f"messages[{i}].tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") \
                    != "function":
                raise _bad(where, 'expected {"id": ..., "type": "function", "function": {"name": ..., '
                                  '"arguments": "<JSON text>"}}')
            arguments = fn.get("arguments", "")
            if not isinstance(arguments, str):
                raise _bad(f"{where}.function.arguments", "must be a string (the arguments as JSON text)")
            call_id = call.get("id", "")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.id", "must be a string")
            out.tool_calls.add(index=j, id=call_id, name=fn["name"], arguments=arguments)
        if m.tool_call_id is not None:
            out.tool_call_id = m.tool_call_id
        if m.role == "tool" and m.name is not None:
            out.name = m.name


def _json_text(param: str, value) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (ValueError, RecursionError):  # nesting past Python's recursion limit
        raise _bad(param, "nested too deeply") from None


def _response_format(value: dict, message: pb.GenerateRequest) -> None:
    """OpenAI's response_format -> GenerateRequest.constraint."""
    kind = value.get("type")
    if kind == "text":
        if set(value) - {"type"}:
            raise _bad("response_format", f"unknown keys {sorted(set(value) - {'type'})}")
        return
    if kind == "json_object":
        if set(value) - {"type"}:
            raise _bad("response_format", f"unknown keys {sorted(set(value) - {'type'})}")
        message.constraint.json_object = True
        return
    if kind != "json_schema":
        raise _bad("response_format.type", f"must be one of text, json_object, json_schema, got {kind!r:.60}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", 'expected {"name": ..., "schema": {...}, "strict": true}')
    if unknown := set(spec) - {"name", "schema", "strict", "description"}:
        raise _bad("response_format.json_schema", f"unknown keys {sorted(unknown)}")
    if not isinstance(spec.get("name", ""), str):
        raise _bad("response_format.json_schema.name", "must be a string")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise _bad("response_format.json_schema.schema", f"must be a JSON schema object, got {type(schema).__name__}")
    strict = spec.get("strict", False)
    if not isinstance(strict, bool) and strict is not None:
        raise _bad("response_format.json_schema.strict", "must be a boolean")
    message.constraint.json_schema = _json_text("response_format.json_schema.schema", schema)
    message.constraint.strict = bool(strict)


def _tools(body: ChatCompletionRequest, message: pb.GenerateRequest) -> None:
    for i, tool in enumerate(body.tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", 'expected {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise _bad(f"tools[{i}].function", f"unknown keys {sorted(unknown)}")
        if not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}].function.name", "required, a string")
        if not isinstance(fn.get("description", ""), str):
            raise _bad(f"tools[{i}].function.description", "must be a string")
        out = message.tools.add(name=fn["name"], description=fn.get("description", ""))
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise _bad(f"tools[{i}].function.parameters", "must be a JSON schema object")
            out.parameters_json = _json_text(f"tools[{i}].function.parameters", fn["parameters"])
    choice = body.tool_choice
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f'must be "none", "auto", "required" or a function, got {choice!r:.60}')
        message.tool_choice.mode = choice
        return
    fn = choice.get("function")
    if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
    message.tool_choice.function = fn["name"]


def _method(value: str | dict) -> pb.AttentionMethod:
    """The body's method, a name or {"name": ..., hyperparameters by name} (as the SDK's Method.coerce reads it)."""
    try:
        if isinstance(value, str):
            return method_message(value, {}, {})
        named, params = split_method(value)
        return method_message(named.pop("name", ""), named, params)
    except FieldValueError as e:  # a value of the wrong type for its field: named as the body names it
        raise _bad(f"retopk.method.{e.field}", e.reason) from None
    except (TypeError, ValueError) as e:
        raise _bad("retopk.method", str(e)) from None


# ---------------------------------------------------------------------------------------------- request
def generate_message(body: Body, vocab_size: int, max_new_tokens: int | None = None) -> pb.GenerateRequest:
    """The GenerateRequest a body means (unchecked beyond what building the message checks and the ranges of
    max_tokens (1 to ``max_new_tokens``, the server's limit) and of top_logprobs, which the message's unsigned
    fields could not carry below 0)."""
    message = pb.GenerateRequest()
    chat = isinstance(body, ChatCompletionRequest)
    if chat:
        _messages(body, message)
    else:
        _prompt(body, message, vocab_size)
    if body.n is not None:
        if body.n < 1:
            raise _bad("n", f"must be at least 1, got {body.n}")
        _set(message, "n", body.n, "n")
    if body.response_format is not None:
        _response_format(body.response_format, message)
    if chat:
        _tools(body, message)
    max_tokens = body.max_tokens
    if chat and body.max_completion_tokens is not None:
        if max_tokens is not None and max_tokens != body.max_completion_tokens:
            raise _bad("max_completion_tokens", "set at most one of max_tokens and max_completion_tokens")
        max_tokens = body.max_completion_tokens
    if max_tokens is not None:
        _set(message, "max_new_tokens", max_tokens, "max_completion_tokens" if chat and body.max_tokens is None
             else "max_tokens", None if max_new_tokens is None else (1, max_new_tokens))
    if body.stop is not None:
        message.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.cache_salt is not None:
        message.cache_salt = body.cache_salt
    for name in _OPENAI_SAMPLING:
        if (value := getattr(body, name)) is not None:
            _set(message.sampling, name, value, name)
    options = body.retopk
    if options is not None:
        for name in _RETOPK_SAMPLING:
            if (value := getattr(options, name)) is not None:
                _set(message.sampling, name, value, f"retopk.{name}")
        if options.session_id is not None:
            message.session_id = options.session_id
        message.chat_history = options.chat_history
        if options.method is not None:
            message.method.CopyFrom(_method(options.method))
        message.ignore_eos = options.ignore_eos
        if options.stop_token_ids:
            message.stop_token_ids.extend(_token_ids("retopk.stop_token_ids", options.stop_token_ids, vocab_size))
        for name in ("regex", "grammar"):
            if (value := getattr(options, name)) is not None:
                if message.HasField("constraint"):
                    raise _bad(f"retopk.{name}", "set at most one of response_format (json), retopk.regex and "
                                                 "retopk.grammar")
                setattr(message.constraint, name, value)
    if chat:
        if body.top_logprobs and not body.logprobs:
            raise _bad("top_logprobs", "needs logprobs: true")
        message.logprobs = body.logprobs
        _set(message, "top_logprobs", body.top_logprobs or 0, "top_logprobs", (0, MAX_TOP_LOGPROBS))
    elif body.logprobs is not None:
        message.logprobs = True
        _set(message, "top_logprobs", body.logprobs, "logprobs", (0, MAX_TOP_LOGPROBS))
    return message


# ---------------------------------------------------------------------------------------------- outputs
FINISH = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CONTEXT_LENGTH: "length",
    pb.FINISH_REASON_EOS_TOKEN: "stop",
    pb.FINISH_REASON_STOP_TOKEN: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def finish_reason(response: pb.GenerateResponse) -> str | None:
    return FINISH.get(response.finish_reason)


def usage(*finals: pb.GenerateResponse) -> dict:
    """OpenAI usage of a request from the last response of each of its choices: the prompt counted once, with the
    prompt tokens the prefix cache supplied (``prompt_tokens_details.cached_tokens``)."""
    prompt = finals[0].usage.prompt_tokens if finals else 0
    cached = finals[0].usage.cached_prompt_tokens if finals else 0
    completion = sum(r.usage.generated_tokens for r in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def tool_call_deltas(response: pb.GenerateResponse) -> list[dict] | None:
    """The streamed ``tool_calls`` delta of a response: id, type and name with a call's first piece."""
    out = []
    for c in response.tool_calls:
        piece = {"index": c.index}
        if c.id:
            piece.update(id=c.id, type="function")
        piece["function"] = {"name": c.name, "arguments": c.arguments} if c.name else {"arguments": c.arguments}
        out.append(piece)
    return out or None


def whole_tool_calls(responses: list[pb.GenerateResponse]) -> list[dict] | None:
    """The complete ``tool_calls`` of one choice's responses (pieces joined per call index)."""
    calls: dict[int, dict] = {}
    for r in responses:
        for c in r.tool_calls:
            call = calls.setdefault(c.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] = call["id"] or c.id
            call["function"]["name"] = call["function"]["name"] or c.name
            call["function"]["arguments"] += c.arguments
    return [calls[i] for i in sorted(calls)] or None


def by_choice(responses: list[pb.GenerateResponse]) -> list[list[pb.GenerateResponse]]:
    """Responses grouped by their choice ``index``, in index order."""
    groups: dict[int, list] = {}
    for r in responses:
        groups.setdefault(r.index, []).append(r)
    return [groups[i] for i in sorted(groups)]


def _token(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(response: pb.GenerateResponse) -> dict | None:
    """OpenAI chat ``logprobs`` of a response: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if not response.logprobs:
        return None
    return {"content": [{**_token(lp.token, lp.logprob), "top_logprobs": [_token(t.token, t.logprob) for t in lp.top]}
                        for lp in response.logprobs]}


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, built response by response (``text_offset``: where each
    token's string starts in the completion, counting the token strings)."""

    def __init__(self) -> None:
        self.offset = 0

    def of(self, response: pb.GenerateResponse) -> dict | None:
        if not response.logprobs:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in response.logprobs:
            out["tokens"].append(lp.token)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({t.token: t.logprob for t in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(lp.token)
        return out


def merge_logprobs(total: dict | None, part: dict | None) -> dict | None:
    """Concatenate two logprobs objects of the same kind (chat or completions)."""
    if part is None:
        return total
    if total is None:
        return {k: list(v) for k, v in part.items()}
    for k, v in part.items():
        total[k].extend(v)
    return total


def envelope(kind: str, request_id: str, model: str, created: int | None = None) -> dict:
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{request_id}", "object": kind, "created": created or int(time.time()), "model": model}
