"""What a Generate call asks the engine for and what the engine hands back, free of gRPC."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from retopk_server.runtime.constraints import ConstraintLimits
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling import SamplingParams


class ErrorCode(enum.Enum):
    """Why a request failed; the service maps each onto the gRPC status code of the same name."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    CANCELLED = "CANCELLED"
    INTERNAL = "INTERNAL"


class EngineError(Exception):
    """A failure the caller can act on: a code and a message that names the offending field."""

    MAX_CHARS = 500  # a status message at most: gRPC sends it in a trailer, which clients cap at 8 KiB

    def __init__(self, code: ErrorCode, message: str) -> None:
        if len(message) > self.MAX_CHARS:
            message = message[:self.MAX_CHARS] + "..."
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"EngineError({self.code.value}, {self.message!r})"


class FinishReason(enum.Enum):
    """Why generation stopped (values match the proto's FinishReason numbers)."""

    LENGTH = 1
    EOS_TOKEN = 2
    STOP_TOKEN = 3
    STOP_SEQUENCE = 4
    CONTEXT_LENGTH = 5
    TOOL_CALLS = 6


@dataclass(frozen=True)
class EngineConfig:
    """The scheduler's limits.

    max_queue               requests waiting for admission; one more is RESOURCE_EXHAUSTED
    max_running             requests decoded together in one batch (a request with n choices counts n; one is
                            admitted into an empty batch even when n exceeds it)
    constraints             bounds of a constraint's size, nesting and compile time (runtime/constraints.py)
    max_sessions            open named sessions; one more is RESOURCE_EXHAUSTED
    max_prompt_tokens       tokens one request may feed (None: the model's context length)
    max_new_tokens          largest max_new_tokens a request may ask for
    default_max_new_tokens  max_new_tokens of a request that does not set it
    max_step_tokens         tokens one loop iteration computes: one per running request's decode step, the
                            rest (at least one) as prefill chunks of the request being admitted, so a long
                            prompt is fed across iterations while the running streams go on
    idle_wait_s             how long the idle loop sleeps between checks (it is woken on new work)
    session_idle_timeout_s  close a named session unused for this long, freeing its KV cache and
                            method state (None: keep sessions until closed)
    watchdog_timeout_s      with work pending, a loop iteration that has not ended after this long means the
                            engine thread hangs: the engine fails (engine/supervision.py; None: no watchdog).
                            Far above the longest legitimate iteration, which ``max_step_tokens`` bounds
    prefix_cache_shared     cached prompt prefixes are shared by every caller (only ``cache_salt`` separates
                            them); False: by the requests of one API key (runtime/prefix_cache.py ``namespace``)
    """

    max_queue: int = 64
    max_running: int = 16
    constraints: ConstraintLimits = field(default_factory=ConstraintLimits)
    max_sessions: int = 64
    max_prompt_tokens: int | None = None
    max_new_tokens: int = 2048
    default_max_new_tokens: int = 256
    max_step_tokens: int = 512
    idle_wait_s: float = 0.5
    session_idle_timeout_s: float | None = None
    watchdog_timeout_s: float | None = 300.0
    prefix_cache_shared: bool = False

    def __post_init__(self) -> None:
        for name in ("session_idle_timeout_s", "watchdog_timeout_s"):
            timeout = getattr(self, name)
            if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                        or not timeout > 0):
                raise ValueError(f"{name} must be a positive number or None, got {timeout!r}")
        for name in ("max_queue", "max_running", "max_sessions", "max_new_tokens", "default_max_new_tokens",
                     "max_step_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_prompt_tokens is not None and (not isinstance(self.max_prompt_tokens, int)
                                                   or self.max_prompt_tokens <= 0):
            raise ValueError(f"max_prompt_tokens must be a positive integer or None, got {self.max_prompt_tokens!r}")
        if self.default_max_new_tokens > self.max_new_tokens:
            raise ValueError(f"default_max_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.default_max_new_tokens}")
        if not self.idle_wait_s > 0:
            raise ValueError(f"idle_wait_s must be positive, got {self.idle_wait_s!r}")
        if not isinstance(self.prefix_cache_shared, bool):
            raise ValueError(f"prefix_cache_shared must be True or False, got {self.prefix_cache_shared!r}")


MAX_TOP_LOGPROBS = 20
"""Most alternatives ``top_logprobs`` may ask for per token (reported as ModelInfo.limits.max_top_logprobs)."""

MAX_N = 16
"""Most choices ``n`` one request may ask for (reported as ModelInfo.limits.max_n)."""

MAX_TOOLS = 64
"""Most tools one request may offer (reported as ModelInfo.limits.max_tools)."""

TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCall:
    """A tool call, or a piece of one in a stream: the first piece of call ``index`` has ``id`` and ``name``,
    later pieces add to ``arguments`` (JSON text)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token and, when asked, of the most likely alternatives.

    The distribution is log_softmax of the logits after the penalties and the temperature (at
    temperature 0: after the penalties, at T = 1), before top-k / top-p / min-p truncation.
    ``top`` holds (token_id, logprob) pairs, most likely first (length ``top_logprobs``).
    ``token`` and ``top_tokens`` (parallel to ``top``) are each token's text decoded alone (special
    tokens kept; a piece of a multi-byte character decodes to U+FFFD).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    token: str = ""
    top_tokens: tuple[str, ...] = ()


@dataclass
class GenerationRequest:
    """One Generate call, already checked by the boundary (service/wire.py; ``assert_checked`` holds).

    Exactly one of ``text``, ``token_ids``, ``chat`` is set. ``max_new_tokens`` None means the
    engine's default. ``deadline`` is a ``time.monotonic()`` instant or None. ``logprobs`` asks for
    each generated token's TokenLogprob, ``top_logprobs`` (0..MAX_TOP_LOGPROBS, needs ``logprobs``)
    for that many alternatives with it.
    """

    request_id: str
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[dict] | None = None
    chat_history: bool = False  # ``chat`` is the whole conversation, replacing the session's (turn.py)
    session_id: str | None = None
    owner: str = ""  # the caller's key name (service/auth.py); session_id names one of its sessions
    method: MethodSpec | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    return_step_stats: bool = False
    deadline: float | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # constrained decoding (runtime/constraints.py): what was asked, and its compiled grammar (the service
    # compiles it before submitting, off the engine thread)
    constraint: object | None = None  # ConstraintSpec
    grammar: object | None = None  # xgrammar CompiledGrammar of ``constraint``
    n: int = 1  # choices of one prompt (one prefill, forked)
    # tools (chat only): OpenAI-style [{"type": "function", "function": {name, description, parameters}}]
    tools: list[dict] | None = None
    tool_choice: str = "auto"  # "none", "auto", "required" or "function"
    tool_function: str | None = None  # with tool_choice "function": the function's name
    cache_salt: str = ""  # separates this request's cached prefixes from those of other salts (prefix_cache.py)

    def assert_checked(self, max_new_tokens: int) -> None:
        """The invariants the boundary (service/wire.py, which refuses a client's request naming the field)
        establishes, for requests built in-process too: a failure is a caller's bug (INTERNAL over the wire),
        never a client's input. ``max_new_tokens`` is the engine's limit (EngineConfig.max_new_tokens)."""
        assert self.max_new_tokens is None or 1 <= self.max_new_tokens <= max_new_tokens, \
            f"unchecked request: max_new_tokens {self.max_new_tokens!r} outside [1, {max_new_tokens}]"
        assert 1 <= self.n <= MAX_N and (self.n == 1 or self.session_id is None), \
            f"unchecked request: n {self.n!r} (in [1, {MAX_N}], 1 with a session_id)"
        assert 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS and (self.logprobs or not self.top_logprobs), \
            f"unchecked request: top_logprobs {self.top_logprobs!r} (in [0, {MAX_TOP_LOGPROBS}], needs logprobs)"
        assert self.constraint is None or self.grammar is not None, \
            "unchecked request: constraint not compiled (Engine.constraints().compile)"

    @property
    def input_field(self) -> str:
        """Name of the input field that is set (for error messages)."""
        return "text" if self.text is not None else "token_ids" if self.token_ids is not None else "chat"


@dataclass
class Usage:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    session_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those whose KV blocks came from the prefix cache


@dataclass
class Timings:
    queue_s: float = 0.0
    prefill_s: float = 0.0
    time_to_first_token_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0


@dataclass
class TokenEvent:
    """One stream message: a generated token (or none) and, on the last one, the end.

    step_stats is the runtime's StepStats of the step that produced the token (only when asked);
    logprobs holds one TokenLogprob per entry of token_ids (only when asked).
    """

    token_ids: list[int]
    text: str
    token_index: int = 0
    step_stats: object | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    session_id: str = ""
    logprobs: list[TokenLogprob] | None = None
    index: int = 0  # the choice (of the request's n) this event belongs to
    tool_calls: list[ToolCall] | None = None
