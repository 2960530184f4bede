"""Hooks the engine and the service call where things happen, so metrics live in one other module.

Every method is a no-op here; ``retopk_server.metrics`` subclasses EngineObserver and records
what it needs. Hooks run on the thread where the event happens (the engine thread, except
``on_rpc`` and ``on_error`` with request None, which run on the asyncio thread), so they must be
quick and must not raise (the engine logs and ignores an exception from a hook).

``request`` is the engine's ActiveRequest (fields: ``request.spec`` the GenerationRequest,
``request.method`` the MethodSpec in effect, ``request.session_id``, ``request.ephemeral``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("retopk_server.engine")


def hook_of(observer: EngineObserver) -> Callable[..., None]:
    """``hook(name, *args)`` calls ``observer.name(*args)``; an exception there is logged, never raised: a metrics
    bug must not take the engine down."""
    def hook(name: str, *args) -> None:
        try:
            getattr(observer, name)(*args)
        except Exception:
            log.exception("observer hook %s failed", name)

    return hook


class EngineObserver:
    """No-op hooks; override the ones you need."""

    #: Set True to make the engine collect per-step attention statistics for every running request
    #: (``on_step`` then receives them even when no request asked for them).
    wants_step_stats: bool = False

    def on_start(self, info, memory) -> None:
        """The runner is built (engine thread, before any request): ``info`` its ModelInfo, ``memory()``
        its cache bytes (a ``runtime.memory.MemoryUsage``; call it only from hooks on the engine thread)."""

    def on_queue_wait(self, request, seconds: float) -> None:
        """A request left the admission queue after ``seconds`` of waiting."""

    def on_prefill(self, request, num_tokens: int, seconds: float) -> None:
        """A request's new tokens went through the model."""

    def on_prefix_lookup(self, request, num_tokens: int, cached_tokens: int) -> None:
        """A request's ``num_tokens`` prompt tokens were looked up in the prefix cache, its first ``cached_tokens``
        of them found (runtime/prefix_cache.py)."""

    def on_first_token(self, request, seconds: float) -> None:
        """A request produced its first token, ``seconds`` after it arrived (time to first token)."""

    def on_token(self, request) -> None:
        """A request produced one token (the first one included)."""

    def on_step(self, requests: list, seconds: float, stats: list | None) -> None:
        """One batched decode step of ``requests`` took ``seconds``.

        stats: the step's ``retopk_server.runtime.stats.StepStatsBatch`` (its rows in the order of ``requests``:
        stacked (B, layers, heads) tensors, ``stats[i]`` row i's StepStats), or None when nobody asked for them.
        """

    def on_finish(self, request, reason: str, usage, timings) -> None:
        """A request ended normally; reason is a FinishReason name ("LENGTH", "EOS_TOKEN", ...)."""

    def on_error(self, request, code: str) -> None:
        """A request (or, with request None, an rpc before it reached the engine) failed with ``code``
        (an ErrorCode / gRPC status name such as "INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED")."""

    def on_load(self, queued: int, running: int, sessions: int) -> None:
        """Queue depth, batch size and open named sessions, reported once per scheduler iteration."""

    def on_session_opened(self, session_id: str, ephemeral: bool) -> None:
        """A session was opened (``ephemeral``: a request's own, closed when it ends)."""

    def on_session_closed(self, session_id: str, ephemeral: bool) -> None:
        """A session was closed and its caches freed."""

    def on_session_evicted(self, session_id: str) -> None:
        """An idle named session was closed to make room in the cache budget (after its on_session_closed)."""

    def on_rpc(self, method: str, code: str, seconds: float) -> None:
        """An rpc of the service ended (``method`` e.g. "Generate", ``code`` e.g. "OK")."""
