"""One request's turn inside the engine: its state, the tokens it feeds, and how it ends.

Input: text is encoded (special tokens only at the start of a conversation), token ids are taken as the
boundary checked them (service/wire.py; the runner asserts they are in the vocabulary), and chat input of a
named session re-renders the whole conversation and feeds only what the cache lacks. The feed is the
session's pending token (the previous turn's last sample) plus the new tokens; what only the tokenizer and
the session can tell (no tokens, too long) is refused here, naming the input field. Finish: a stop token /
string, max_new_tokens or the context length ends the turn; the turn's
tokens and reply are remembered in the session for the next one.

Constraints and tools: a request with a compiled grammar samples through a RowConstraint
(runtime/constraints.py) and ends once the grammar is complete; a chat request with tools renders them
through the template and turns its reply into tool calls (engine/tools.py). n > 1: after the prompt's
prefill the request forks into n choices (``fork``), each an ActiveRequest of its own on a forked
session, sharing the stream; each ends with its own last event, the stream with the last of them.
"""

from __future__ import annotations

import dataclasses
import time

from retopk_server.engine.requests import (
    EngineError,
    ErrorCode,
    FinishReason,
    GenerationRequest,
    Timings,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.session_table import SessionRecord
from retopk_server.engine.stream import RequestStream
from retopk_server.engine.tools import parser_for
from retopk_server.runtime.constraints import RowConstraint
from retopk_server.runtime.method_spec import MethodSpec
from retopk_server.runtime.sampling import Sampler, StopChecker


class ActiveRequest:
    """A request inside the engine: its spec, its stream and the state of its generation."""

    def __init__(self, spec: GenerationRequest, stream: RequestStream, max_new_tokens: int) -> None:
        self.spec = spec
        self.stream = stream
        # None: the session's method (named session) or the default (resolved at admission)
        self.method: MethodSpec | None = spec.method
        self.max_new_tokens = max_new_tokens
        self.arrived = time.monotonic()
        self.admitted = self.prefilled = self.first_token_at = 0.0
        self.record: SessionRecord | None = None
        self.prompt_ids: list[int] = []  # this request's new input tokens
        self.feed_ids: list[int] = []  # the tokens admission feeds (``feed``: pending + new), once its session is taken
        self.context_ids: list[int] = []  # everything in the cache after prefill (for the penalties)
        self.generated: list[int] = []
        self.text_parts: list[str] = []
        self.last_token = -1
        self.prefill_s = 0.0
        self.cached_tokens = 0  # of the fed tokens, those the prefix cache supplied (runtime/prefix_cache.py)
        self.job = None  # the runner's PrefillJob while the prompt is fed (runtime/prefill.py)
        self.sampler: Sampler | None = None
        self.stop: StopChecker | None = None
        self.constraint: RowConstraint | None = None
        self.tools = None  # the reply's tool-call parser (engine/tools.py) or None
        self.tool_calls: list = []  # the calls made so far, as pieces (for the session's memory)
        self.events: list[TokenEvent] = []  # what a named session's turn streamed (engine/idempotency.py)
        self.index = 0  # which of the request's n choices this is
        self.done = False

    @property
    def session_id(self) -> str | None:
        return self.spec.session_id

    @property
    def ephemeral(self) -> bool:
        return self.spec.session_id is None

    def expired(self, now: float) -> bool:
        return self.spec.deadline is not None and now >= self.spec.deadline

    def dropped(self, now: float, where: str = "") -> EngineError | None:
        """Why the request must end now (deadline passed, client cancelled), or None to go on.

        A passed deadline also cancels the call, so it is checked first and reported as the deadline.
        """
        if self.expired(now):
            return EngineError(ErrorCode.DEADLINE_EXCEEDED, f"deadline exceeded{where}")
        if self.stream.cut_error is not None:  # the server ended it (RequestStream.cut)
            return self.stream.cut_error
        if self.stream.cancelled:
            return EngineError(ErrorCode.CANCELLED, f"request cancelled by the client{where}")
        if self.stream.closed and not self.done:  # another choice of the request failed and ended the stream
            return EngineError(ErrorCode.CANCELLED, f"another choice of the request failed{where}")
        return None

    # ---- input ---------------------------------------------------------------------------------------
    def feed(self, runner: Runner, max_prompt_tokens: int | None) -> list[int]:
        """The tokens to prefill (pending + new input), checked against the limits; sets ``prompt_ids``.

        A chat whose rendering differs from what the session holds (an edited or regenerated history, a reply
        the template renders otherwise) rewinds the session to the longest common token prefix first (after the
        input checks, so a turn refused for its input leaves the session as it was): ``runner.rewind`` keeps the
        KV cache up to there, resets the method state, and the feed re-renders from what it kept (at least the
        method's last ``prefill_queries`` tokens, which its prefill observes again, as a fresh session's would)."""
        field, info, record = self.spec.input_field, runner.info, self.record
        new_ids, full, common = self._input_ids(runner)
        rewinding = common is not None
        if rewinding:  # at least the last token is fed again: its logits start the reply (a regenerated turn)
            base = max(0, min(common, record.session.length, len(full) - 1))
            new_ids = feed = full[base:]
        else:
            base, feed = record.session.length, record.pending + new_ids
        if not new_ids:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{field}: the input has no tokens")
        limit = max_prompt_tokens or info.max_context
        if len(new_ids) > limit:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"{field}: too long: {len(new_ids)} tokens, the limit is {limit}")
        if base + len(feed) > info.max_context:
            raise EngineError(ErrorCode.INVALID_ARGUMENT,
                              f"{field}: too long: {len(feed)} new tokens after {base} "
                              f"in the session exceed the context length {info.max_context}")
        if rewinding:
            kept = runner.rewind(record.session, base) if base < record.session.length else base
            record.pending = []
            feed = new_ids = full[kept:]
        self.prompt_ids = new_ids
        return feed

    def _input_ids(self, runner: Runner) -> tuple[list[int], list[int] | None, int | None]:
        """(this request's new tokens, the whole rendered chat, the length of its common prefix with what the
        session holds when the session must rewind to it, else None); the session's pending token excluded."""
        spec, record = self.spec, self.record
        if spec.text is not None:  # special tokens (a BOS) only at the start of a conversation
            return list(runner.encode(spec.text, add_special_tokens=record.num_tokens == 0)), None, None
        if spec.token_ids is not None:
            return list(spec.token_ids), None, None
        if record.ephemeral:
            return encode_chat(runner, spec.chat, spec.tools), None, None
        # The session remembers the conversation: render all of it and feed what the cache lacks. Chat templates
        # render earlier turns the same way, so the seen tokens are normally a prefix; when they are not, the
        # session rewinds to the common prefix (``feed``).
        seen = record.seen_ids
        full = encode_chat(runner, self.history() + spec.chat, spec.tools)
        common = common_prefix(full, seen)
        return full[common:], full, (None if common == len(seen) else common)

    def history(self) -> list[dict]:
        """The conversation before this turn's messages: the session's, or none when the request sends it whole
        (``chat_history``)."""
        return [] if self.spec.chat_history else self.record.messages

    def start_sampling(self, runner: Runner) -> None:
        """After prefill: the sampler (with the request's constraint), the stop conditions and the tool-call
        parser of this choice; choice i > 0 of a seeded request draws with seed + i."""
        spec = self.spec
        eos = set() if spec.ignore_eos else set(runner.info.eos_token_ids)
        if spec.grammar is not None:
            self.constraint = RowConstraint.of(spec.grammar, runner.info.vocab_size)
        sampling = spec.sampling
        if self.index and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=(sampling.seed + self.index) % 2**63)
        self.sampler = Sampler(sampling, spec.top_logprobs if spec.logprobs else None, self.constraint)
        self.stop = StopChecker(runner.tokenizer, sorted(eos | set(spec.stop_token_ids)), list(spec.stop))
        self.tools = parser_for(spec.tool_choice, spec.tools) if spec.chat is not None else None

    def fork(self, record: SessionRecord, index: int) -> ActiveRequest:
        """Choice ``index`` of this request (n > 1), on ``record`` (a fork of this request's prefilled session),
        right after the prefill: it shares the stream, the prompt and the timings so far."""
        child = ActiveRequest(self.spec, self.stream, self.max_new_tokens)
        child.index, child.record, child.method = index, record, self.method
        child.arrived, child.admitted, child.prefilled, child.prefill_s = (self.arrived, self.admitted,
                                                                          self.prefilled, self.prefill_s)
        child.prompt_ids, child.context_ids, child.cached_tokens = self.prompt_ids, self.context_ids, self.cached_tokens
        return child

    # ---- finish --------------------------------------------------------------------------------------
    def push(self, token: int, max_context: int, step_stats) -> TokenEvent:
        """Record one sampled token -> its event; ``finish_reason`` is set when the turn ends with it."""
        self.generated.append(token)
        self.last_token = token
        text, stopped = self.stop.push(token)
        reason = None
        if stopped:
            why = self.stop.stop_reason
            reason = (FinishReason.STOP_SEQUENCE if isinstance(why, str)
                      else FinishReason.STOP_TOKEN if why in self.spec.stop_token_ids else FinishReason.EOS_TOKEN)
        elif self.constraint is not None and self.constraint.terminated:  # the grammar is complete
            reason = FinishReason.EOS_TOKEN
        elif len(self.generated) >= self.max_new_tokens:
            reason = FinishReason.LENGTH
        elif self.record.session.length >= max_context:  # no room to feed this token
            reason = FinishReason.CONTEXT_LENGTH
        if reason is not None and not stopped:
            text += self.stop.flush()
        calls = None
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if reason is not None:
                more, last = self.tools.finish()
                text, calls = text + more, calls + last
            self.tool_calls.extend(calls)
            if reason in (FinishReason.EOS_TOKEN, FinishReason.STOP_TOKEN, FinishReason.STOP_SEQUENCE) \
                    and self.tools.called:
                reason = FinishReason.TOOL_CALLS
        self.text_parts.append(text)
        return TokenEvent([token], text, token_index=len(self.generated) - 1,
                          step_stats=step_stats if self.spec.return_step_stats else None, finish_reason=reason,
                          logprobs=self._logprobs(token), index=self.index, tool_calls=calls or None)

    def _logprobs(self, token: int) -> list[TokenLogprob] | None:
        """The sampler's log-probabilities of ``token`` (just sampled), with each token's text alone."""
        if self.sampler.last_logprobs is None:
            return None
        logprob, top = self.sampler.last_logprobs
        decode = self.stop.tokenizer.decode
        return [TokenLogprob(token, logprob, top, token=decode([token]),
                             top_tokens=tuple(decode([t]) for t, _ in top))]

    def timings(self, end: float) -> Timings:
        return Timings(queue_s=self.admitted - self.arrived, prefill_s=self.prefill_s,
                       time_to_first_token_s=self.first_token_at - self.arrived,
                       decode_s=end - self.first_token_at, total_s=end - self.arrived)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), generated_tokens=len(self.generated),
                     session_tokens=self.record.num_tokens, cached_tokens=min(self.cached_tokens, len(self.prompt_ids)))

    def remember_turn(self) -> None:
        """Keep what the next turn needs in the session: the unfed last token, the chat, the turn count."""
        record = self.record
        if self.generated:  # the tokens no decode step fed: the last one, none after a failed sampling
            record.pending = self.generated[len(record.session.token_ids) - len(self.context_ids):]
        if self.prefilled and self.spec.chat is not None and not record.ephemeral:
            reply = {"role": "assistant", "content": "".join(self.text_parts)}
            if calls := whole_calls(self.tool_calls):
                reply["tool_calls"] = calls
            record.messages = self.history() + list(self.spec.chat) + [reply]
        if self.prefilled:
            record.turns += 1


def whole_calls(pieces) -> list[dict]:
    """Tool-call pieces (ToolCall) joined per index into OpenAI's {"id", "type", "function"} objects."""
    calls: dict[int, dict] = {}
    for p in pieces:
        call = calls.setdefault(p.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call["id"] = call["id"] or p.id
        call["function"]["name"] = call["function"]["name"] or p.name
        call["function"]["arguments"] += p.arguments
    return [calls[i] for i in sorted(calls)]


def encode_chat(runner: Runner, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The conversation's token ids; INVALID_ARGUMENT naming ``chat`` when the template rejects it."""
    try:
        return list(runner.encode_chat(messages, tools) if tools else runner.encode_chat(messages))
    except Exception as e:  # a template that rejects the messages (e.g. a bad role order)
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"chat: the chat template rejected the messages: {e}") from None


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
