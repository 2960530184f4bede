"""Where the sessions a lingering drain handed over went (service/handoff.py), for the notice a call on one gets."""

from __future__ import annotations

NOTICE_METADATA = "x-retopk-handoff"  # trailer: the address where a moved session continues


class HandoffNotices:
    """(owner, session id) -> the address its session moved to."""

    def __init__(self) -> None:
        self._moved: dict[tuple[str, str], str] = {}

    def record(self, owner: str, session_id: str, address: str) -> None:
        self._moved[(owner, session_id)] = address

    def where(self, owner: str, session_id: str | None) -> str | None:
        """The new home of ``owner``'s session ``session_id``; None when it did not move (or is another key's:
        the notice goes to the owner only)."""
        return None if session_id is None else self._moved.get((owner, session_id))
