"""Delivery: what reaches a request's client from the engine thread: each sampled token, the last event, or the
error that ends the request; and the request's hold on its session let go when it ends.

A failure while sampling or streaming one row ends that request alone, with a status that names the stage
(faults.request_error). A named session's turn is remembered for a retry under the same request_id
(engine/idempotency.py): its events when it finished, how far it got when it failed with tokens out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from retopk_server.engine.faults import request_error
from retopk_server.engine.idempotency import Answer, digest
from retopk_server.engine.requests import EngineError, TokenEvent
from retopk_server.engine.session_table import SessionTable
from retopk_server.engine.turn import ActiveRequest

log = logging.getLogger("retopk_server.engine")


class Delivery:
    """Sample and stream a row's token, finish or fail a request (see the module docstring)."""

    def __init__(self, sessions: SessionTable, hook: Callable[..., None]) -> None:
        self.sessions = sessions
        self.hook = hook

    def step_row(self, r: ActiveRequest, logits, stats, token: int | None = None) -> None:
        """Sample the request's next token from its logits (vocab,) unless ``token`` is it already, and stream
        it. A failure ends this request alone, with a status that names the stage."""
        stage = "sampling"
        try:
            if token is None:
                token = r.sampler.sample(logits, r.generated, r.context_ids)
            stage = "streaming the token"
            self._stream(r, token, stats)
        except Exception as e:
            log.exception("%s of request %s failed", stage, r.spec.request_id)
            self.fail(r, request_error(stage, e))

    def _stream(self, r: ActiveRequest, token: int, stats) -> None:
        """Stream ``token``; when it ends the turn, let go of the session first, then send the last event."""
        now = time.monotonic()
        event: TokenEvent = r.push(token, self.sessions.runner.info.max_context, stats)
        if len(r.generated) == 1:
            r.first_token_at = now
            self.hook("on_first_token", r, now - r.arrived)
        self.hook("on_token", r)
        if not r.ephemeral:
            r.events.append(event)
        if event.finish_reason is None:
            r.stream.put(event)
            return
        event.timings = r.timings(time.monotonic())
        self.release(r)  # before the last event: the caller's next turn must find the session free
        event.usage = r.usage()
        event.session_id = "" if r.ephemeral else r.spec.session_id
        if not r.ephemeral:
            r.record.answers.remember(r.spec.request_id, Answer(digest(r.spec), events=r.events))
        r.stream.put(event)
        self.hook("on_finish", r, event.finish_reason.name, event.usage, event.timings)

    def fail(self, r: ActiveRequest, error: EngineError) -> None:
        """End the request with ``error`` (unless its last event is out); a failed release is logged. A choice
        of an n > 1 request whose stream another choice's failure already ended just lets go of its session."""
        if r.done and r.stream.closed:
            return
        try:
            if not r.done:
                self.release(r)
        except Exception:
            log.exception("releasing the session of request %s failed", r.spec.request_id)
        finally:
            if not r.stream.closed:
                if r.events and r.record is not None and not r.ephemeral:  # tokens out: the session keeps them
                    r.record.answers.remember(r.spec.request_id, Answer(
                        digest(r.spec), error=f"{error.code.value}: {error.message}", kept=len(r.generated)))
                r.stream.fail(error)
                self.hook("on_error", r, error.code.value)

    def release(self, r: ActiveRequest) -> None:
        """End the request's hold on its session: remember the turn, close an ephemeral session."""
        r.done = True
        if r.record is None:  # never admitted
            if not r.ephemeral:
                self.sessions.unreserve(r.session_id, r.spec.owner)
            return
        r.remember_turn()
        self.sessions.release(r.record)
