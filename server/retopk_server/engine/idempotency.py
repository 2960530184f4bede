"""A retried Generate is answered once: each named session remembers its last turns by request id.

A client that lost a stream (a dropped connection, a timeout before the first message) and sends the same
request again, with the same ``request_id``, must not run that turn twice into the session. For
WINDOW_S seconds after a turn ended, and for the session's last KEPT turns, a request naming the same
session and request id, with the same input and options (``digest``: another request that reuses an id is
not a retry and runs), is answered from this record instead of the model:

- a turn that finished: its events again, token for token, ending with its final message (usage, timings);
- a turn that ended early (cancelled, past its deadline, failed) after streaming tokens, which the session
  keeps: FAILED_PRECONDITION naming the request id, how it ended and how many tokens the session kept;
- a turn still running: FAILED_PRECONDITION, the session is busy (SessionTable.reserve), as before.

A turn that ended before any token (refused, cancelled while queued or prefilling) left the session as it
was, so it is not remembered and a retry runs. Request ids the server makes up never repeat.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

WINDOW_S = 120.0
KEPT = 8


def digest(spec) -> str:
    """What makes two GenerationRequests the same request: their input and every option but the deadline."""
    fields = (spec.text, spec.token_ids, spec.chat, spec.chat_history, spec.max_new_tokens, spec.sampling, spec.stop,
              spec.stop_token_ids, spec.ignore_eos, spec.logprobs, spec.top_logprobs, spec.constraint, spec.tools,
              spec.tool_choice, spec.tool_function, spec.return_step_stats)
    return hashlib.sha256(repr(fields).encode()).hexdigest()


@dataclass
class Answer:
    """How one turn ended: ``events`` (every TokenEvent, the last one final) when it finished, else ``error``
    (its status message) and ``kept`` (the tokens it streamed, which the session holds); ``digest`` the request's."""

    digest: str
    events: list = field(default_factory=list)
    error: str = ""
    kept: int = 0
    at: float = field(default_factory=time.monotonic)


class Answers:
    """One session's remembered turns, by request id (the last KEPT, each for WINDOW_S seconds)."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, Answer] = OrderedDict()

    def remember(self, request_id: str, answer: Answer) -> None:
        self._by_id[request_id] = answer
        self._by_id.move_to_end(request_id)
        while len(self._by_id) > KEPT:
            self._by_id.popitem(last=False)

    def get(self, request_id: str, request_digest: str, now: float | None = None) -> Answer | None:
        """The answer to the same request (id and digest) within the window, else None."""
        answer = self._by_id.get(request_id)
        now = time.monotonic() if now is None else now
        if answer is None or answer.digest != request_digest or now - answer.at > WINDOW_S:
            return None
        return answer
