"""Building request messages from the SDK's keyword arguments (shared by the sync and asyncio clients)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

from retopk_client.types import (
    SAMPLING_FIELDS,
    ChatMessage,
    Constraint,
    FieldValueError,
    Method,
    Sampling,
    Tool,
    as_chat_message,
    set_field,
    tool_choice_proto,
)
from retopk_proto.retopk.v1 import retopk_pb2 as pb

MessageLike = ChatMessage | Mapping[str, str] | tuple[str, str]


def sampling_from(sampling: Sampling | Mapping[str, Any] | None, overrides: Mapping[str, Any]) -> Sampling | None:
    """A Sampling from an object or mapping, with plain keyword overrides (temperature=..., seed=...)."""
    unknown = set(overrides) - set(SAMPLING_FIELDS)
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
    base = dict(sampling) if isinstance(sampling, Mapping) else (asdict(sampling) if sampling else {})
    base.update({k: v for k, v in overrides.items() if v is not None})
    return Sampling(**base) if base else None


def chat_proto(messages: Iterable[MessageLike]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[as_chat_message(m).to_proto() for m in messages])


def generate_request(
    prompt: str | None = None,
    *,
    messages: Iterable[MessageLike] | None = None,
    token_ids: Sequence[int] | None = None,
    session_id: str | None = None,
    max_new_tokens: int | None = None,
    sampling: Sampling | Mapping[str, Any] | None = None,
    method: Method | str | Mapping[str, Any] | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    return_step_stats: bool = False,
    logprobs: bool = False,
    top_logprobs: int = 0,
    request_id: str | None = None,
    constraint: Constraint | None = None,
    tools: Iterable[Tool | Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    n: int | None = None,
    chat_history: bool = False,
    cache_salt: str | None = None,
    **sampling_kwargs: Any,
) -> pb.GenerateRequest:
    """The GenerateRequest for one call; exactly one of prompt, messages, token_ids must be given.

    request_id: unset in a session, a random one (a retry of the call sends it again: answered once).
    constraint: a ``Constraint`` (JSON schema, JSON object, regex, grammar); tools: ``Tool``s or OpenAI-style
    tool mappings, with ``tool_choice`` "none" / "auto" / "required" / {"name": ...}; n: choices of one prompt;
    chat_history: ``messages`` is the whole conversation, replacing the session's (an edited history rewinds it)."""
    inputs = (("prompt", prompt), ("messages", messages), ("token_ids", token_ids))
    given = [name for name, value in inputs if value is not None]
    if len(given) != 1:
        raise TypeError(f"give exactly one of prompt, messages, token_ids (got {', '.join(given) or 'none'})")
    if isinstance(stop, str):
        stop = [stop]
    req = pb.GenerateRequest()
    for name, value in (("ignore_eos", ignore_eos), ("return_step_stats", return_step_stats),
                        ("logprobs", logprobs), ("top_logprobs", top_logprobs)):
        set_field(req, name, value, name)
    for name, values in (("stop", stop), ("stop_token_ids", stop_token_ids)):
        _set_repeated(req, name, values)
    if prompt is not None:
        set_field(req, "text", prompt, "prompt")
    elif messages is not None:
        req.chat.CopyFrom(chat_proto(messages))
    else:
        req.token_ids.CopyFrom(pb.TokenIds(ids=list(token_ids)))
    if request_id is None and session_id is not None:
        # a turn of a session carries an id of its own, so that a retry of it is answered once (the server's
        # engine/idempotency.py) instead of running twice into the session
        request_id = uuid.uuid4().hex
    for name, value in (("request_id", request_id), ("session_id", session_id), ("max_new_tokens", max_new_tokens),
                        ("cache_salt", cache_salt)):
        if value is not None:
            set_field(req, name, value, name)
    samp = sampling_from(sampling, sampling_kwargs)
    if samp is not None:
        req.sampling.CopyFrom(_within("sampling", samp.to_proto))
    meth = Method.coerce(method)
    if meth is not None:
        req.method.CopyFrom(_within("method", meth.to_proto))
    if constraint is not None:
        req.constraint.CopyFrom(_within("constraint", constraint.to_proto))
    for tool in tools or ():
        req.tools.append(Tool.coerce(tool).to_proto())
    if (choice := tool_choice_proto(tool_choice)) is not None:
        req.tool_choice.CopyFrom(choice)
    if n is not None:
        set_field(req, "n", n, "n")
    if chat_history:
        set_field(req, "chat_history", chat_history, "chat_history")
    return req


def _within(prefix: str, to_proto):
    """``to_proto()``, a FieldValueError naming its field inside ``prefix`` ("method.top_k")."""
    try:
        return to_proto()
    except FieldValueError as e:
        raise e.within(prefix) from None


def _set_repeated(message, name: str, values) -> None:
    """Extend a repeated scalar field, checking each value's type (FieldValueError naming ``name[i]``); the
    message is the caller's own, discarded on an error."""
    field, fd = getattr(message, name), message.DESCRIPTOR.fields_by_name[name]
    for i, value in enumerate(values):
        try:
            field.append(value)
        except (TypeError, ValueError):
            kind = "a string" if fd.cpp_type == fd.CPPTYPE_STRING else "a non-negative integer"
            raise FieldValueError(f"{name}[{i}]", f"must be {kind}, got {value!r:.60}") from None


def new_session_id() -> str:
    """A session id chosen by the client, so that CreateSession already carries the routers' affinity key."""
    return uuid.uuid4().hex


def create_session_request(method: Method | str | Mapping[str, Any] | None, session_id: str | None):
    req = pb.CreateSessionRequest()
    if session_id is not None:
        set_field(req, "session_id", session_id, "session_id")
    meth = Method.coerce(method)
    if meth is not None:
        req.method.CopyFrom(_within("method", meth.to_proto))
    return req


SESSION_CHUNK_BYTES = 1 << 20  # the server's bound on one chunk (ModelInfo.limits.max_session_chunk_bytes)


def import_session_requests(artifact: bytes, session_id: str | None) -> list[pb.ImportSessionRequest]:
    """The ImportSession stream of an artifact: chunks of at most SESSION_CHUNK_BYTES, the id in the first."""
    data = memoryview(bytes(artifact))
    out = [pb.ImportSessionRequest(data=bytes(data[at:at + SESSION_CHUNK_BYTES]))
           for at in range(0, len(data), SESSION_CHUNK_BYTES)] or [pb.ImportSessionRequest()]
    if session_id is not None:
        set_field(out[0], "session_id", session_id, "session_id")
    return out


def tokenize_request(text: str | None, messages: Iterable[MessageLike] | None) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise TypeError("give exactly one of text, messages")
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=chat_proto(messages))
