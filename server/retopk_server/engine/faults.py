"""Failures inside the engine, sorted by what they end: one request, or the whole engine.

A per-request failure (an exception while prefilling, decoding, sampling or streaming one request) ends
that request alone, with a status that names the stage and the cause (``request_error``):
RESOURCE_EXHAUSTED for an allocation failure (MemoryError, torch.OutOfMemoryError, the cache budget's
BudgetExceeded), INTERNAL for anything else. The other requests go on.

After a runner call failed the engine asks whether the runner itself is broken (``runner_broken``): a
runner that raised ``RunnerBroken``, or one that can no longer prefill and decode one token of a fresh
session (the probe), is. Then the engine loop ends with ``EngineFailed``: every request still queued or
running gets UNAVAILABLE, health turns NOT_SERVING and the process exits non-zero
(service/server.py), so that an orchestrator restarts it. An allocation failure of the probe means
memory pressure, not a broken runner. A loop that hangs without raising is caught by the watchdog
(engine/supervision.py): ``EngineHung``, with the same outcome.
"""

from __future__ import annotations

import logging

import torch

from retopk_server.engine.requests import EngineError, ErrorCode
from retopk_server.engine.runner_protocol import Runner

log = logging.getLogger("retopk_server.engine")

MAX_CAUSE_CHARS = 300  # an exception's text quoted in a status message, at most


class RunnerBroken(Exception):
    """Raised by a runner whose state can no longer be trusted (e.g. a device error poisoned its context)."""


class EngineFailed(Exception):
    """The engine loop cannot go on (the runner is broken); the server must restart."""


class EngineHung(EngineFailed):
    """The engine loop made no progress for longer than the watchdog's timeout while work was pending."""


def _memory_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [MemoryError, torch.OutOfMemoryError]
    try:  # the runtime's cache budget refusing an allocation is memory pressure too
        from retopk_server.runtime.budget import BudgetExceeded
    except ImportError:
        pass
    else:
        errors.append(BudgetExceeded)
    return tuple(errors)


MEMORY_ERRORS = _memory_errors()


def out_of_memory(exc: BaseException) -> bool:
    """An allocation failed (host or device memory, or the cache budget): pressure, not a bug."""
    return isinstance(exc, MEMORY_ERRORS)


def cause(exc: BaseException) -> str:
    """``Type: message``, the message cut to MAX_CAUSE_CHARS."""
    text = str(exc)
    if len(text) > MAX_CAUSE_CHARS:
        text = text[:MAX_CAUSE_CHARS] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def request_error(stage: str, exc: BaseException) -> EngineError:
    """The status that ends one request whose ``stage`` ("prefill", "decode", "sampling", ...) raised ``exc``."""
    if isinstance(exc, EngineError):
        return exc
    if out_of_memory(exc):
        return EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"out of memory during {stage} ({cause(exc)}); "
                                                         "retry later or with a shorter input")
    return EngineError(ErrorCode.INTERNAL, f"{stage} failed: {cause(exc)}")


def engine_failed_error(failure: BaseException) -> EngineError:
    """The status of every request still held by an engine that failed with ``failure``."""
    return EngineError(ErrorCode.UNAVAILABLE, f"the server's engine failed ({cause(failure)}); retry on a "
                                              "restarted server")


def check_runner(runner: Runner, error: Exception) -> None:
    """EngineFailed when the runner is broken after it raised ``error``."""
    if (why := runner_broken(runner, error)) is not None:
        raise EngineFailed(f"the runner is broken: {cause(error)}; probe: {cause(why)}") from why


def runner_broken(runner: Runner, exc: BaseException) -> BaseException | None:
    """Why the runner is broken after it raised ``exc`` (``exc`` itself, or the probe's failure), or None.

    The probe opens a session of the default method, prefills and decodes one token, and closes it.
    """
    if isinstance(exc, RunnerBroken):
        return exc
    session = None
    try:
        session = runner.open_session(runner.info.default_method)
        token = runner.info.eos_token_ids[0] if runner.info.eos_token_ids else 0
        runner.prefill(session, [token])
        runner.decode([session], [token])
    except Exception as probe:  # noqa: BLE001 - the probe's verdict
        if out_of_memory(probe) or isinstance(probe, EngineError):
            log.warning("runner probe ran out of memory (%s); not treating the runner as broken", cause(probe))
            return None
        return probe
    finally:
        if session is not None:
            try:
                runner.close_session(session)
            except Exception:  # noqa: BLE001 - a failed close is the probe's failure already reported
                log.exception("closing the probe session failed")
    return None
