"""A conversation's state on the runner: its tokens, KV blocks and per-layer method-state slots."""

from __future__ import annotations

from retopk_server.runtime.method_spec import MethodSpec


class Session:
    """Owned by the runner; NOT thread-safe (the engine thread alone touches it).

    token_ids  the tokens whose keys and values are in the cache, in order (a later turn appends)
    length     len(token_ids): the next token's position
    blocks     KV block ids (the same ids in every layer), enough for ``length`` positions
    slots      per layer, the session's slot in its method's state pool of that layer; None until the session
               first needs its method state (its first prefill): an empty session holds none
    """

    def __init__(self, session_id: str, method: MethodSpec, slots: list[int] | None, block_nbytes: int,
                 state_nbytes: int) -> None:
        self.id = session_id
        self.method = method
        self.token_ids: list[int] = []
        self.blocks: list[int] = []
        self.slots = slots
        self.closed = False
        self._block_nbytes = block_nbytes
        self._state_nbytes = state_nbytes

    @property
    def length(self) -> int:
        return len(self.token_ids)

    def nbytes(self) -> dict[str, int]:
        """Device memory held: KV blocks allocated (all layers, keys and values) and method state slots."""
        return {"kv": len(self.blocks) * self._block_nbytes,
                "method_state": self._state_nbytes if self.slots is not None else 0}

    def __repr__(self) -> str:
        return f"Session(id={self.id!r}, method={self.method.name!r}, length={self.length})"
