"""Where the sessions a lingering drain handed over went (service/handoff.py), for the notice a call on one gets.

A call can come while the drain is still at work: during its grace, or before its session's turn in the handoff.
Such a call waits (``wait``, at most HOLD_S) until its session's fate is known: moved, it gets the notice and the
SDK follows it at once, instead of the drain's plain UNAVAILABLE and a blind retry that reaches the notice only
if it comes late enough. A session the drain will not hand over (another key's id, an unknown one, a session
saved or lost instead) is released as soon as the drain's list of sessions, or its end, says so. Everything here
runs on the server's event loop.
"""

from __future__ import annotations

import asyncio

NOTICE_METADATA = "x-retopk-handoff"  # trailer: the address where a moved session continues
HOLD_S = 10.0  # the longest a call waits for its session's handoff (the drain's grace, then its turn in the list)

Key = tuple[str, str]  # (owner, session id)


class HandoffNotices:
    """(owner, session id) -> the address its session moved to; and, while a lingering drain hands sessions over,
    which of them are still to go."""

    def __init__(self) -> None:
        self._moved: dict[Key, str] = {}
        self._handing_over = False  # begun and not finished
        self._pending: set[Key] | None = None  # the sessions still to go; None before the drain lists them
        self._change: asyncio.Event | None = None  # set at the next change, for the calls that wait

    def begin(self) -> None:
        """A lingering drain started: its sessions will be handed over (the list comes with ``expect``)."""
        self._handing_over = True
        self._changed()

    def expect(self, keys) -> None:
        """The sessions the drain hands over, in its order."""
        self._pending = set(keys)
        self._changed()

    def record(self, owner: str, session_id: str, address: str) -> None:
        self._moved[(owner, session_id)] = address
        self.settle(owner, session_id)

    def settle(self, owner: str, session_id: str) -> None:
        """That session's fate is known (moved, or saved or lost: no notice)."""
        if self._pending is not None:
            self._pending.discard((owner, session_id))
        self._changed()

    def finish(self) -> None:
        """The handoff is over: no call waits any more."""
        self._handing_over = False
        self._changed()

    def where(self, owner: str, session_id: str | None) -> str | None:
        """The new home of ``owner``'s session ``session_id``; None when it did not move (or is another key's:
        the notice goes to the owner only)."""
        return None if session_id is None else self._moved.get((owner, session_id))

    async def wait(self, owner: str, session_id: str | None, timeout: float = HOLD_S) -> str | None:
        """``where``, once the handoff under way settled that session (module docstring), ``timeout`` seconds at
        most; at once when no handoff is under way."""
        if session_id is None:
            return None
        key = (owner, session_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._handing_over and key not in self._moved and (self._pending is None or key in self._pending):
            if self._change is None:
                self._change = asyncio.Event()
            try:
                await asyncio.wait_for(self._change.wait(), deadline - loop.time())
            except TimeoutError:
                break
        return self.where(owner, session_id)

    def _changed(self) -> None:
        if self._change is not None:
            self._change.set()
            self._change = None
