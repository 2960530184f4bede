"""SessionRecord: a runtime session plus what the engine remembers about its conversation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class SessionRecord:
    """One session as the engine sees it.

    session     the runner's Session (KV blocks, method-state slots, ``token_ids`` in the cache)
    pending     tokens the model produced but has not yet fed back (the last sampled token of a turn);
                the next turn feeds them before its own input
    messages    the chat conversation so far (user turns and the server's replies), for chat input
    busy        a request holds the session (set at submission, cleared when the request ends)
    ephemeral   opened for one request and closed when it ends
    """

    session: object
    ephemeral: bool = False
    pending: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    busy: bool = False
    turns: int = 0
    created_unix: float = field(default_factory=time.time)
    last_used_unix: float = 0.0

    def __post_init__(self) -> None:
        if not self.last_used_unix:
            self.last_used_unix = self.created_unix

    @property
    def id(self) -> str:
        return self.session.id

    @property
    def seen_ids(self) -> list[int]:
        """Every token of the conversation so far: in the cache, then pending."""
        return list(self.session.token_ids) + self.pending

    @property
    def num_tokens(self) -> int:
        return self.session.length + len(self.pending)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
