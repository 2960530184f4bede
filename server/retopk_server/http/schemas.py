"""Request bodies of the OpenAI-compatible endpoints, as pydantic models (types only; bounds live where the
gRPC service checks them, ``retopk_server.service.wire`` and the engine, so both fronts share them).

Unknown fields are refused (400 naming the field) and types are strict: ``"temperature": "0.5"`` or
``"max_tokens": true`` is a 400, not a silent conversion. Shapes that take several types (``prompt``, a
message's ``content``) are checked in ``retopk_server.http.openai_bodies`` with messages that name the field.

retopk's own options travel in one extra object, ``retopk`` (``extra_body={"retopk": {...}}`` with the
openai package); see ``RetopkOptions``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class RetopkOptions(_Body):
    """retopk's extensions of a request.

    method            the attention method: a name ("retopk", "full", ...) or an object with ``name`` and
                      its hyperparameters by the core's names, e.g. {"name": "retopk", "top_k": 64, "tau": 0.9}
                      (the SDK's ``Method.coerce`` reads it; absent: the server's default method)
    session_id        continue this session (created with the gRPC CreateSession or ``retopk session``):
                      its KV cache is reused, so send only the turn's new prompt or new messages
    chat_history      with session_id: ``messages`` is the whole conversation (as OpenAI clients send it),
                      replacing the session's; an edited history rewinds the session to the common prefix
                      (GenerateRequest.chat_history)
    top_k, min_p, repetition_penalty
                      the sampler's other knobs (GenerateRequest.sampling)
    ignore_eos, stop_token_ids
                      as in GenerateRequest
    regex, grammar    constrain the output to a regular expression, or to an EBNF grammar whose start rule is
                      ``root`` (GenerateRequest.constraint; instead of ``response_format``)
    """

    method: str | dict[str, Any] | None = None
    session_id: str | None = None
    chat_history: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    regex: str | None = None
    grammar: str | None = None


class _Generation(_Body):
    """The fields both endpoints share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    # {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name", "schema",
    # "strict", "description"}}; its shape is checked in http/openai_bodies.py, naming the field
    response_format: dict[str, Any] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    cache_salt: str | None = None  # vLLM's: separates this request's cached prefixes (GenerateRequest.cache_salt)
    retopk: RetopkOptions | None = None


class CompletionRequest(_Generation):
    """POST /v1/completions. prompt: a string, a list of one string, token ids, or a list of one list of ids.
    logprobs: how many alternatives to report per token (0: only the sampled token's logprob)."""

    prompt: str | list[Any]
    logprobs: int | None = None


class ChatMessage(_Body):
    """content: a string or a list of {"type": "text", "text": ...} parts. An assistant message may carry the
    ``tool_calls`` a previous reply made ([{"id", "type": "function", "function": {"name", "arguments"}}]);
    a "tool" message answers one, naming its ``tool_call_id``. ``name`` is passed to the template for a tool
    message, accepted and unused otherwise."""

    role: str
    content: str | list[Any] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Generation):
    """POST /v1/chat/completions. logprobs: report the sampled tokens' logprobs; top_logprobs: with that many
    alternatives. max_completion_tokens is OpenAI's newer name of max_tokens (set at most one)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    # [{"type": "function", "function": {"name", "description", "parameters", "strict"}}], checked in openai_bodies
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # accepted; a forced call is one call, "auto" may make several
    logprobs: bool = False
    top_logprobs: int | None = None
