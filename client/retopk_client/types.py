"""Typed, immutable views of the wire messages, so SDK users never touch protobuf classes.

Each dataclass mirrors one message of proto/retopk/v1/retopk.proto and converts with
``from_proto`` (and ``to_proto`` for inputs). Fields the server leaves unset stay ``None`` where
the proto marks them optional. ``to_dict`` gives JSON-ready data for the CLI's ``--json``.
Inputs are not range-checked here: the server validates every field and answers INVALID_ARGUMENT
naming it, so there is one source of truth for the limits.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace

from retopk_proto.retopk.v1 import retopk_pb2 as pb
from retopk_shared.fields import (  # noqa: F401 - FieldValueError: part of the SDK's types too
    RETOPK_FIELDS,
    FieldValueError,
    ParamValue,
    method_message,
    set_field,
    split_method,
)

# The fields of SamplingParameters, from the proto's descriptors (the wire contract defines them once).
SAMPLING_FIELDS = tuple(f.name for f in pb.SamplingParameters.DESCRIPTOR.fields)


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


class _Dictable:
    """Base of the views: ``to_dict`` for JSON, ``from_proto`` copying the message's fields of the same names."""

    def to_dict(self) -> dict:
        return _jsonable(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_proto(cls, msg):
        return _from_fields(cls, msg)


def _from_fields(cls, msg, **converted):
    """``cls`` from the message's fields of the same names (repeated fields as tuples); ``converted`` gives the
    fields that need more than a copy (nested messages)."""
    values = {}
    for f in fields(cls):
        if f.name not in converted:
            value = getattr(msg, f.name)
            values[f.name] = value if isinstance(value, int | float | str | bytes) else tuple(value)
    return cls(**values, **converted)


# ---- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall(_Dictable):
    """A tool call the model made (``Completion.tool_calls``: whole), or a piece of one (``Chunk.tool_calls``):
    ``arguments`` is JSON text; in a stream the pieces of one ``index`` concatenate to it."""

    index: int = 0
    id: str = ""
    name: str = ""
    arguments: str = ""

    def to_proto(self) -> pb.ToolCall:
        return pb.ToolCall(index=self.index, id=self.id, name=self.name, arguments=self.arguments)


@dataclass(frozen=True)
class ChatMessage(_Dictable):
    """One chat message: role is "system", "user", "assistant" or "tool". An assistant message may carry the
    ``tool_calls`` it made; a "tool" message answers one, quoting its ``tool_call_id``."""

    role: str
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def to_proto(self) -> pb.ChatMessage:
        return pb.ChatMessage(role=self.role, content=self.content, tool_calls=[c.to_proto() for c in self.tool_calls],
                              tool_call_id=self.tool_call_id, name=self.name)


def _tool_call(value) -> ToolCall:
    """A ToolCall from itself, or an OpenAI-style {"id", "function": {"name", "arguments"}} mapping."""
    if isinstance(value, ToolCall):
        return value
    fn = value.get("function", value)
    arguments = fn.get("arguments", "")
    return ToolCall(id=value.get("id", ""), name=fn.get("name", ""),
                    arguments=arguments if isinstance(arguments, str) else json.dumps(arguments))


def as_chat_message(message: ChatMessage | Mapping | tuple[str, str]) -> ChatMessage:
    """Accept a ChatMessage, a {"role", "content"} mapping (with OpenAI's "tool_calls" / "tool_call_id" /
    "name" where they apply) or a (role, content) pair."""
    if isinstance(message, ChatMessage):
        return message
    if isinstance(message, Mapping):
        calls = tuple(replace(_tool_call(c), index=i) for i, c in enumerate(message.get("tool_calls") or ()))
        return ChatMessage(role=message["role"], content=message.get("content") or "", tool_calls=calls,
                           tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "")
    role, content = message
    return ChatMessage(role=role, content=content)


@dataclass(frozen=True)
class Tool(_Dictable):
    """A function the model may call: ``parameters`` its arguments' JSON schema (None: any object)."""

    name: str
    description: str = ""
    parameters: Mapping | None = None

    def to_proto(self) -> pb.Tool:
        return pb.Tool(name=self.name, description=self.description,
                       parameters_json=json.dumps(self.parameters) if self.parameters is not None else "")

    @classmethod
    def coerce(cls, value: Tool | Mapping) -> Tool:
        """A Tool from itself or an OpenAI-style {"type": "function", "function": {...}} (or the inner) mapping."""
        if isinstance(value, Tool):
            return value
        fn = value.get("function", value)
        return cls(name=fn["name"], description=fn.get("description", ""), parameters=fn.get("parameters"))


def tool_choice_proto(value: str | Mapping | None) -> pb.ToolChoice | None:
    """"none" / "auto" / "required", a function's name as {"name": ...} or OpenAI's {"type": "function",
    "function": {"name": ...}} -> the ToolChoice message (None: the server's default, auto)."""
    if value is None:
        return None
    if isinstance(value, str):
        return pb.ToolChoice(mode=value)
    fn = value.get("function", value)
    return pb.ToolChoice(function=fn["name"])


@dataclass(frozen=True)
class Constraint(_Dictable):
    """A constraint on the output (GenerateRequest.constraint): build it with ``json_schema``, ``json_object``,
    ``regex`` or ``grammar``."""

    kind: str
    text: str = ""
    strict: bool = False

    @classmethod
    def json_schema(cls, schema: Mapping | str, strict: bool = False) -> Constraint:
        """One JSON value valid against ``schema`` (a mapping or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema), strict)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        """An EBNF (GBNF) grammar whose start rule is ``root``."""
        return cls("grammar", ebnf)

    def to_proto(self) -> pb.Constraint:
        if self.kind == "json_object":
            return pb.Constraint(json_object=True)
        if self.kind not in ("json_schema", "regex", "grammar"):
            raise ValueError(f"unknown constraint kind {self.kind!r}")
        return pb.Constraint(**{self.kind: self.text}, strict=self.strict)


@dataclass(frozen=True)
class Sampling(_Dictable):
    """Sampling parameters; ``None`` means the server default for that field (``ModelInfo.default_sampling``:
    the model's generation config, else chat defaults). ``temperature=0`` is greedy."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None

    def to_proto(self) -> pb.SamplingParameters:
        """The wire message; FieldValueError naming the field its type cannot hold."""
        msg = pb.SamplingParameters()
        for f in SAMPLING_FIELDS:
            if getattr(self, f) is not None:
                set_field(msg, f, getattr(self, f), f)
        return msg

    @classmethod
    def from_proto(cls, msg: pb.SamplingParameters) -> Sampling:
        """The fields the message sets (floats as the float32's 7 digits: 0.9 arrives as 0.899999976)."""
        values = {f: getattr(msg, f) for f in SAMPLING_FIELDS if msg.HasField(f)}
        return cls(**{k: float(f"{v:.7g}") if isinstance(v, float) else v for k, v in values.items()})


@dataclass(frozen=True)
class Method(_Dictable):
    """An attention method and its hyperparameters (``name=""``: the server's default method).

    The named fields are ReTopK's K, C, W, R, tau, T_r (Exact Top-K reads ``top_k``); other
    hyperparameters of any method go in ``params`` by the core's keyword names, e.g.
    ``Method("streaming_llm", params={"sink": 4})``. ``None`` fields take the server's defaults.
    """

    name: str = ""
    top_k: int | None = None
    cache_size: int | None = None
    window: int | None = None
    recall: int | None = None
    tau: float | None = None
    refresh_every: int | None = None
    params: Mapping[str, ParamValue] = field(default_factory=dict)

    @classmethod
    def full(cls) -> Method:
        return cls("full")

    @classmethod
    def exact_topk(cls, top_k: int | None = None) -> Method:
        return cls("exact_topk", top_k=top_k)

    @classmethod
    def retopk(cls, **params: ParamValue | None) -> Method:
        """ReTopK with hyperparameters by name: the named fields (``RETOPK_FIELDS``) and any other config
        field of the core (into ``params``), e.g. ``Method.retopk(top_k=64, gqa_policy="group")``."""
        named = {k: v for k, v in params.items() if k in RETOPK_FIELDS}
        return cls("retopk", **named, params={k: v for k, v in params.items() if k not in RETOPK_FIELDS})

    @classmethod
    def coerce(cls, value: Method | str | Mapping | None) -> Method | None:
        """Accept a Method, a method name, or a mapping of Method's fields (unknown keys go to params)."""
        if value is None or isinstance(value, Method):
            return value
        if isinstance(value, str):
            return cls(value)
        named, params = split_method(value)
        return cls(**named, params=params)

    def to_proto(self) -> pb.AttentionMethod:
        """The wire message; FieldValueError naming the hyperparameter its type cannot hold."""
        return method_message(self.name, {f: getattr(self, f) for f in RETOPK_FIELDS}, self.params)

    @classmethod
    def from_proto(cls, msg: pb.AttentionMethod) -> Method:
        named = {f: getattr(msg, f) if msg.HasField(f) else None for f in RETOPK_FIELDS}
        if named["tau"] is not None:  # a proto float: 0.85 arrives as 0.8500000238...; keep float32's 7 digits
            named["tau"] = float(f"{named['tau']:.7g}")
        params = {key: _param_from_proto(value) for key, value in sorted(msg.params.items())}
        return cls(name=msg.name, **named, params=params)

    def describe(self) -> str:
        """One line, e.g. ``retopk(top_k=512, cache_size=32, ...)``."""
        parts = [f"{f}={getattr(self, f)}" for f in RETOPK_FIELDS if getattr(self, f) is not None]
        parts += [f"{k}={v}" for k, v in self.params.items()]
        return f"{self.name or '<default>'}({', '.join(parts)})"


def _param_from_proto(value: pb.ParamValue) -> ParamValue | None:
    kind = value.WhichOneof("kind")
    return None if kind is None else getattr(value, kind)


# ---- outputs ---------------------------------------------------------------------------------


class FinishReason(str, enum.Enum):
    """Why generation stopped (the proto enum without its prefix, lower case)."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_TOKEN = "stop_token"
    STOP_SEQUENCE = "stop_sequence"
    CONTEXT_LENGTH = "context_length"
    TOOL_CALLS = "tool_calls"

    @classmethod
    def from_proto(cls, value: int) -> FinishReason | None:
        if value == pb.FINISH_REASON_UNSPECIFIED:
            return None
        name = pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()
        return cls(name)


# StepStats.path codes by name, read from the proto's AttentionPath enum (the client installs without the core,
# whose retopk_core.methods.base.Path they mirror; tests/server checks they agree).
PATH_NAMES = {v.number: v.name.removeprefix("ATTENTION_PATH_").lower() for v in pb.AttentionPath.DESCRIPTOR.values}


def group_read_rate(steps: Iterable[StepStats]) -> float | None:
    """Share of (layer, KV group, step) triples whose keys were read in full, over the given steps:
    sum of true ``group_read`` entries / number of entries. None when no step carries ``group_read``
    (a server older than the field)."""
    reads = total = 0
    for step in steps:
        reads += sum(step.group_read)
        total += len(step.group_read)
    return reads / total if total else None


@dataclass(frozen=True)
class StepStats(_Dictable):
    """One decode step of one sequence: per (layer, head) arrays, row-major ``[l * num_heads + h]``, and
    per (layer, KV group) ``group_read``, row-major ``[l * num_kv_heads + g]`` (True: the group's keys
    were read in full on this step)."""

    token_index: int
    num_layers: int
    num_heads: int
    path: tuple[int, ...]
    max_sim: tuple[float, ...]
    n_scored: tuple[int, ...]
    attention_seconds: float
    num_kv_heads: int = 0
    group_read: tuple[bool, ...] = ()

    def path_counts(self) -> dict[str, int]:
        """How many (layer, head) pairs took each path, by path name."""
        counts: dict[str, int] = {}
        for code in self.path:
            name = PATH_NAMES.get(code, str(code))
            counts[name] = counts.get(name, 0) + 1
        return counts

    def group_read_rate(self) -> float | None:
        """Share of this step's (layer, KV group) pairs whose keys were read in full (None without group_read)."""
        return group_read_rate((self,))


@dataclass(frozen=True)
class TopLogprob(_Dictable):
    """One of a step's most likely tokens: its id, log-probability (natural log) and text decoded alone."""

    token_id: int
    logprob: float
    token: str = ""


@dataclass(frozen=True)
class TokenLogprob(_Dictable):
    """A generated token's log-probability and, when asked (``top_logprobs``), the step's most likely tokens,
    most likely first. The distribution: log_softmax of the penalised logits divided by the temperature
    (temperature 0: at 1), before top-k / top-p / min-p truncation (see the proto's GenerateRequest.logprobs)."""

    token_id: int
    logprob: float
    token: str = ""
    top: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_proto(cls, msg: pb.TokenLogprob) -> TokenLogprob:
        return cls(token_id=msg.token_id, logprob=msg.logprob, token=msg.token,
                   top=tuple(TopLogprob.from_proto(t) for t in msg.top))


@dataclass(frozen=True)
class Usage(_Dictable):
    """Token counts of one request."""

    prompt_tokens: int
    generated_tokens: int
    session_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, those the server's prefix cache supplied


@dataclass(frozen=True)
class Timings(_Dictable):
    """Where one request's time went, in seconds (as measured by the server)."""

    queue_seconds: float
    prefill_seconds: float
    time_to_first_token_seconds: float
    decode_seconds: float
    total_seconds: float


@dataclass(frozen=True)
class Chunk(_Dictable):
    """One message of a Generate stream. The last has ``finish_reason``, ``usage`` and ``timings``."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    step_stats: tuple[StepStats, ...] = ()
    session_id: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for logprobs
    index: int = 0  # the choice it belongs to (requests with n > 1)
    tool_calls: tuple[ToolCall, ...] = ()  # pieces of the tool calls made (see ToolCall)

    @property
    def is_final(self) -> bool:
        """The last chunk of its choice (of the whole stream when n is 1)."""
        return self.finish_reason is not None

    @classmethod
    def from_proto(cls, msg: pb.GenerateResponse) -> Chunk:
        return cls(
            request_id=msg.request_id,
            token_ids=tuple(msg.token_ids),
            text=msg.text,
            finish_reason=FinishReason.from_proto(msg.finish_reason),
            usage=Usage.from_proto(msg.usage) if msg.HasField("usage") else None,
            timings=Timings.from_proto(msg.timings) if msg.HasField("timings") else None,
            step_stats=tuple(StepStats.from_proto(s) for s in msg.step_stats),
            session_id=msg.session_id or None,
            logprobs=tuple(TokenLogprob.from_proto(lp) for lp in msg.logprobs),
            index=msg.index,
            tool_calls=tuple(ToolCall.from_proto(c) for c in msg.tool_calls),
        )


@dataclass(frozen=True)
class Completion(_Dictable):
    """A whole Generate call gathered: the text, every token id and the final chunk's report."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    usage: Usage | None
    timings: Timings | None
    request_id: str
    session_id: str | None = None
    step_stats: tuple[StepStats, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for logprobs
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the reply made, whole
    index: int = 0  # which choice of the request (n > 1) this is

    def group_read_rate(self) -> float | None:
        """The group-read rate over every step this completion carries stats for (see ``group_read_rate``)."""
        return group_read_rate(self.step_stats)

    def mean_logprob(self) -> float | None:
        """Mean log-probability of the generated tokens (None without logprobs)."""
        return sum(lp.logprob for lp in self.logprobs) / len(self.logprobs) if self.logprobs else None


class CompletionBuilder:
    """Accumulates chunks into a ``Completion`` (shared by the sync and asyncio clients)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.step_stats: list[StepStats] = []
        self.logprobs: list[TokenLogprob] = []
        self.calls: dict[int, ToolCall] = {}
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.step_stats.extend(chunk.step_stats)
        self.logprobs.extend(chunk.logprobs)
        for piece in chunk.tool_calls:
            call = self.calls.get(piece.index) or ToolCall(piece.index)
            self.calls[piece.index] = ToolCall(piece.index, call.id or piece.id, call.name or piece.name,
                                               call.arguments + piece.arguments)
        self.last = chunk

    def build(self) -> Completion:
        last = self.last
        return Completion(
            text="".join(self.text),
            token_ids=tuple(self.token_ids),
            finish_reason=last.finish_reason if last else None,
            usage=last.usage if last else None,
            timings=last.timings if last else None,
            request_id=last.request_id if last else "",
            session_id=last.session_id if last else None,
            step_stats=tuple(self.step_stats),
            logprobs=tuple(self.logprobs),
            tool_calls=tuple(self.calls[i] for i in sorted(self.calls)),
            index=last.index if last else 0,
        )


def completions_of(chunks: Iterable[Chunk]) -> list[Completion]:
    """The chunks of a request with n > 1 gathered per choice -> one Completion per index, in index order."""
    builders: dict[int, CompletionBuilder] = {}
    for chunk in chunks:
        builders.setdefault(chunk.index, CompletionBuilder()).add(chunk)
    return [builders[i].build() for i in sorted(builders)]


@dataclass(frozen=True)
class SessionInfo(_Dictable):
    """A session's state on the server."""

    session_id: str
    method: Method
    num_tokens: int
    kv_bytes: int
    method_state_bytes: int
    busy: bool
    turns: int
    created_unix: float
    last_used_unix: float

    @classmethod
    def from_proto(cls, msg: pb.SessionInfo) -> SessionInfo:
        return _from_fields(cls, msg, method=Method.from_proto(msg.method))


@dataclass(frozen=True)
class Tokenized(_Dictable):
    """Token ids of an input, with each token's text piece."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]


# The server's limits: one int field per field of the proto's Limits message, made from its descriptor so that
# no limit the server reports can be missing here (``retopk info`` prints them all). 0: not reported.
Limits = make_dataclass("Limits", [(f.name, int, field(default=0)) for f in pb.Limits.DESCRIPTOR.fields],
                        bases=(_Dictable,), frozen=True)
Limits.__module__ = __name__
Limits.__doc__ = ("The server's limits on requests and sessions: " + ", ".join(
    f.name for f in pb.Limits.DESCRIPTOR.fields) + " (the fields of the proto's Limits message).")


@dataclass(frozen=True)
class ModelInfo(_Dictable):
    """The served model, its default attention method, the available methods and the limits."""

    name: str
    architecture: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    backend: str
    default_method: Method
    methods: tuple[str, ...]
    limits: Limits
    server_version: str
    default_sampling: Sampling = Sampling()  # what each unset sampling field of a request takes
    default_sampling_source: str = ""
    weight_format: str = ""  # the matmul weights as served, e.g. "int4, lm_head int8"
    weight_bytes: int = 0  # weight bytes one decode step reads
    kv_dtype: str = ""

    @classmethod
    def from_proto(cls, msg: pb.ModelInfo) -> ModelInfo:
        return _from_fields(cls, msg, default_method=Method.from_proto(msg.default_method),
                            limits=Limits.from_proto(msg.limits),
                            default_sampling=Sampling.from_proto(msg.default_sampling))


@dataclass(frozen=True)
class ServerStatus(_Dictable):
    """The server's load right now."""

    running: int
    queued: int
    sessions: int
    ephemeral_sessions: int
    draining: bool
    kv_bytes: int
    method_state_bytes: int = 0
    cache_budget_bytes: int = 0
    cache_reserved_bytes: int = 0
    sessions_evicted: int = 0
