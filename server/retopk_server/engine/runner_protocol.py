"""Runner: what the engine asks of a model runner, typed, so the engine -> runtime step can be followed.

``retopk_server.runtime.ModelRunner`` implements it (structurally: the runtime does not import the
engine), and so does the tests' ``FakeRunner``. Every call comes from the engine thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from retopk_server.runtime.memory import MemoryUsage
    from retopk_server.runtime.method_spec import MethodSpec
    from retopk_server.runtime.runner import ModelInfo
    from retopk_server.runtime.session import Session
    from retopk_server.runtime.session_state import SessionState
    from retopk_server.runtime.stats import StepStatsBatch


class Tokenizer(Protocol):
    """The part of a transformers tokenizer the engine uses (stop strings, token pieces, detokenizing)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]: ...


class PrefillJob(Protocol):
    """One prompt being fed in chunks (runtime/prefill.py): ``step`` until it returns the logits."""

    begin: int
    end: int

    @property
    def remaining(self) -> int: ...

    def step(self, max_tokens: int) -> torch.Tensor | None:
        """Feed up to ``max_tokens`` more tokens -> (vocab,) logits after the last one, else None."""
        ...

    def abort(self) -> None:
        """Stop before the end: the session is as it was before the job."""
        ...


class Runner(Protocol):
    """A model with sessions: text <-> tokens, prefill one session, decode many in one batched step."""

    info: ModelInfo
    tokenizer: Tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The conversation in the model's chat template, ending with the assistant prompt (with ``tools``
        rendered; the engine passes them only when a request has some)."""
        ...

    def open_session(self, method: MethodSpec | None = None, session_id: str | None = None) -> Session:
        """A new empty session of ``method``; ValueError for an unknown method or bad hyperparameters,
        BudgetExceeded when its method's pools do not fit the cache budget. A runner may allocate the session's
        method state at its first prefill (``start_prefill`` then raises BudgetExceeded for it)."""
        ...

    def close_session(self, session: Session) -> None: ...

    def close_sessions(self, sessions: list[Session]) -> None:
        """``close_session`` of each, whatever the runner does for all of them (its pools' upkeep) once."""
        ...

    def reserve(self, session: Session, length: int) -> None:
        """KV room for ``length`` positions in the session; ValueError past the context, BudgetExceeded
        (runtime/budget.py; nothing allocated) when the cache budget cannot hold it."""
        ...

    def start_prefill(self, session: Session, token_ids: list[int], prefix_key: bytes | None = None) -> PrefillJob:
        """Check ``token_ids`` and reserve their KV room -> the job that feeds them; ValueError or
        BudgetExceeded with nothing changed. ``prefix_key``: the prefix cache's namespace for a session's first
        prefill (runtime/prefix_cache.py); the job's ``cached`` counts the prompt tokens the cache supplied."""
        ...

    def waits_for_prefix(self, session: Session, token_ids: list[int], prefix_key: bytes | None,
                         under_way: list[PrefillJob]) -> bool:
        """Whether a first prompt would take more of its start from the prefix cache once the prefills ``under_way``
        have cached theirs (nothing changes; False without a prefix cache)."""
        ...

    def prefill(self, session: Session, token_ids: list[int]) -> torch.Tensor:
        """Append ``token_ids`` to the session -> (vocab,) logits after the last one; ValueError (nothing
        done) when they do not fit."""
        ...

    def prefill_together(self, plan: list[tuple[PrefillJob, int]]) -> list[torch.Tensor | BaseException | None]:
        """Feed each (job, n) up to n more tokens in shared forwards -> per job what its ``step(n)`` returns, or the
        exception that stopped it (the caller aborts that job)."""
        ...

    def trim_pools(self) -> int:
        """Give back cache memory kept for a load that may come back, once it has been kept long enough (the
        engine calls this when idle) -> bytes freed."""
        ...

    def decode(self, sessions: list[Session], token_ids: list[int], with_stats: bool = False,
               ) -> tuple[torch.Tensor, StepStatsBatch | None]:
        """Feed one token to each session in one forward -> ((B, vocab) logits, the step's stats or None;
        ``stats[i]`` is row i's StepStats)."""
        ...

    def fork(self, source: Session, count: int) -> list[Session]:
        """``count`` new sessions continuing where ``source`` stands (its KV cache shared copy-on-write, its
        method state copied); BudgetExceeded with none opened when they do not fit."""
        ...

    def export_session(self, session: Session) -> SessionState:
        """A copy of the session's tokens, keys, values and method state (runtime/session_state.py)."""
        ...

    def check_import(self, state: SessionState) -> None:
        """StateMismatch (what differs from this runner) or ValueError (a value out of bounds) when ``state`` cannot
        be imported; the one runner call any thread may make."""
        ...

    def import_session(self, state: SessionState, session_id: str | None = None, checked: bool = False) -> Session:
        """A new session holding ``state``; ``check_import``'s errors (unless ``checked``: it passed already) before
        anything is allocated, BudgetExceeded with nothing kept when it does not fit."""
        ...

    def make_room(self, sessions: list[tuple[int, MethodSpec | None]]) -> None:
        """Grow the pools once for sessions about to be imported, (tokens, method with state or None) each, as far
        as the budget allows without evicting (ModelRunner.make_room); a runner without such pools does nothing."""
        ...

    def rewind(self, session: Session, length: int) -> int:
        """Keep at most the session's first ``length`` tokens, its method state reset to a fresh session's ->
        how many it kept (fewer when the method must observe the last ones again at the next prefill)."""
        ...

    def memory(self) -> MemoryUsage:
        """Cache bytes in use by open sessions and reserved by the runner."""
        ...
