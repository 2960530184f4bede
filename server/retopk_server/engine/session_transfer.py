"""Sessions out of and into the engine, on the engine thread: ExportSession and ImportSession (and the session
directory and the handoff on drain, which use the same two).

Export copies an idle named session into a SessionArtifact (engine/session_artifact.py): the runner's
tensors (runtime/session_state.py) and the record's conversation. Import checks, in order, and refuses
with the status in brackets: the model setup (FAILED_PRECONDITION naming every entry that differs), the
owner (PERMISSION_DENIED: only the key that exported a session imports it), the method (FAILED_PRECONDITION
when this server cannot build it or bounds it otherwise), the tensors' shapes and dtypes (FAILED_PRECONDITION)
and values (INVALID_ARGUMENT): ``check_artifact``, which any thread may run; then, on the engine thread, the id and
the session limits (ALREADY_EXISTS, RESOURCE_EXHAUSTED); under memory pressure idle sessions are evicted first,
as for a prompt. The imported session belongs to the
caller and continues exactly where the exported one stood.
"""

from __future__ import annotations

import time

from retopk_core.params import ParamError
from retopk_server.engine.requests import EngineError, ErrorCode
from retopk_server.engine.session_artifact import SessionArtifact, check_model, model_fingerprint
from retopk_server.engine.session_table import SessionRecord, SessionSnapshot, SessionTable, runtime_id
from retopk_server.runtime.budget import BudgetExceeded
from retopk_server.runtime.method_limits import check_method
from retopk_server.runtime.session_state import StateMismatch


def export_session(table: SessionTable, session_id: str, owner: str = "", close: bool = False) -> SessionArtifact:
    """``owner``'s idle session as an artifact; ``close``: closed once copied (the session moves)."""
    record = table.idle_record(session_id, owner)
    artifact = SessionArtifact(state=table.runner.export_session(record.session),
                               model=model_fingerprint(table.runner.info), owner=record.owner, session_id=record.id,
                               pending=list(record.pending), messages=list(record.messages), turns=record.turns,
                               created_unix=record.created_unix, last_used_unix=record.last_used_unix)
    if close:
        table.close(session_id, owner)
    return artifact


def _failed(message: str) -> EngineError:
    return EngineError(ErrorCode.FAILED_PRECONDITION, message)


def check_artifact(runner, artifact: SessionArtifact, owner: str = "") -> None:
    """The import's checks that need no session table (module docstring: all but the id and the session limits),
    as EngineErrors. They read only what ``runner`` fixed at its start, so any thread may run them: a large
    state's bounds are checked off the engine thread, whose decode steps do not wait for them."""
    info = runner.info
    if (diff := check_model(artifact, info)) is not None:
        raise _failed(f"artifact: the session was made by another model setup ({diff})")
    if artifact.owner != owner:
        raise EngineError(ErrorCode.PERMISSION_DENIED, "artifact: the session belongs to another key; only the key "
                                                       "that exported it can import it")
    try:
        check_method(artifact.state.method, info)
    except (ParamError, ValueError) as e:
        raise _failed(f"artifact.method: this server cannot run the session's method: {e}") from None
    if any(not 0 <= t < info.vocab_size for t in artifact.pending):
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"artifact.pending: token ids must lie in [0, {info.vocab_size})")
    if artifact.state.length + len(artifact.pending) > info.max_context:
        raise _failed(f"artifact: {artifact.state.length + len(artifact.pending)} tokens exceed this server's "
                      f"max_context {info.max_context}")
    try:
        runner.check_import(artifact.state)
    except StateMismatch as e:
        raise _failed(f"artifact: {e}") from None
    except ValueError as e:
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"artifact: {e}") from None


def import_session(table: SessionTable, artifact: SessionArtifact, owner: str = "", session_id: str | None = None,
                   max_owned: int | None = None, evict: bool = True, checked: bool = False) -> SessionSnapshot:
    """Open ``artifact``'s session as ``owner``'s ``session_id`` (default: the id it was exported under);
    ``evict=False``: RESOURCE_EXHAUSTED rather than evicting idle sessions when it does not fit (a preload);
    ``checked``: ``check_artifact`` passed already (off the engine thread)."""
    runner = table.runner
    if not checked:
        check_artifact(runner, artifact, owner)
    name = session_id or artifact.session_id
    table.check_new(name, owner, max_owned)
    try:
        if evict:
            session = table.with_room("artifact", runner.import_session, artifact.state, runtime_id(owner, name), True)
        else:
            session = runner.import_session(artifact.state, runtime_id(owner, name), True)
    except BudgetExceeded as e:
        raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"artifact: {e}") from None
    record = SessionRecord(session, owner=owner, name=name, pending=list(artifact.pending),
                           messages=list(artifact.messages), turns=artifact.turns,
                           created_unix=artifact.created_unix, last_used_unix=time.time())  # its import is a use
    return table.adopt(record)
