"""What a session has said and heard, kept on the client so the conversation can be replayed.

A session's KV cache lives in one server replica. When that replica is gone (a call in the session
answers NOT_FOUND or UNAVAILABLE), a session opened with ``replay=True`` opens a new session, feeds it
the whole conversation so far plus the turn that failed as that session's first input, and goes on from
there; the caller sees the turn's completion as if nothing had happened (``Session.replays`` counts
how often it did). One input kind per session: chat ``messages`` (earlier replies go back as assistant
messages), raw ``prompt`` text (earlier prompts and completions concatenated) or ``token_ids``.
"""

from __future__ import annotations

from typing import Any

from retopk_client.errors import NotFound, RetopkError, Unavailable
from retopk_client.types import ChatMessage, Completion, as_chat_message

REPLAYABLE = (NotFound, Unavailable)  # the session's replica is gone (or the session with it)


def input_kind(prompt: str | None, kwargs: dict[str, Any]) -> str:
    if prompt is not None:
        return "prompt"
    return "messages" if kwargs.get("messages") is not None else "token_ids"


def materialized(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's keyword arguments with its messages / token ids as lists (an iterator is read once)."""
    return {k: list(v) if k in ("messages", "token_ids") and v is not None else v for k, v in kwargs.items()}


class Transcript:
    """The session's turns as one input of a single kind (see the module docstring)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.items: list = []  # ChatMessage (messages), str (prompt) or int (token_ids)
        self.mixed = False  # turns of different input kinds: no single input replays them

    def record(self, prompt: str | None, kwargs: dict[str, Any], completion: Completion) -> None:
        kind = input_kind(prompt, kwargs)
        if self.kind not in (None, kind):
            self.mixed = True
        self.kind = kind
        if kind == "messages":
            self.items += [as_chat_message(m) for m in kwargs["messages"]]
            self.items.append(ChatMessage(role="assistant", content=completion.text))
        elif kind == "prompt":
            self.items.append(prompt + completion.text)
        else:
            self.items += [*kwargs["token_ids"], *completion.token_ids]

    def replay_input(self, prompt: str | None, kwargs: dict[str, Any], error: RetopkError):
        """(prompt, kwargs) of the new session's first call: everything so far, then this turn's input."""
        kind = input_kind(prompt, kwargs)
        if self.mixed or self.kind not in (None, kind):
            error.add_note("not replayed: the session's turns mix prompt, messages and token_ids")
            raise error
        kwargs = dict(kwargs)
        if kind == "messages":
            kwargs["messages"] = [*self.items, *(as_chat_message(m) for m in kwargs["messages"])]
        elif kind == "prompt":
            prompt = "".join(self.items) + prompt
        else:
            kwargs["token_ids"] = [*self.items, *kwargs["token_ids"]]
        return prompt, kwargs
