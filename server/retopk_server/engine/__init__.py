"""The engine: one thread that owns the model runner and runs the continuous-batching scheduler.

    scheduler.py        Engine: the thread and its loop (schedule, run, postprocess), submission, lifecycle
    admission.py        the scheduling of prompts: queue -> chunked prefill -> batch, KV room for each step
    supervision.py      the engine's failure handling: decode retried alone, runner probe, shutdown, watchdog
    faults.py           what a failure ends (one request or the engine), the statuses it gets
    commands.py         EngineCommands (sessions, tokenizer, status as futures) over the CommandQueue
    runner_protocol.py  Runner: what the engine asks of a model runner (runtime.ModelRunner implements it)
    sessions.py         SessionTable: named and ephemeral sessions (SessionRecord), their commands and snapshots
    turn.py             ActiveRequest: one request's input tokens (chat re-render diff), stop/finish, timings
    requests.py         what a Generate call asks for, what comes back (events), error codes
    observer.py         EngineObserver: no-op hooks the metrics module overrides
    stream.py           RequestStream: hands events from the engine thread to an asyncio consumer
"""

from retopk_server.engine.observer import EngineObserver
from retopk_server.engine.requests import (
    EngineConfig,
    EngineError,
    ErrorCode,
    FinishReason,
    GenerationRequest,
    TokenEvent,
)
from retopk_server.engine.runner_protocol import Runner
from retopk_server.engine.scheduler import Engine
from retopk_server.engine.sessions import describe_method
from retopk_server.engine.stream import RequestStream

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineObserver",
    "ErrorCode",
    "FinishReason",
    "GenerationRequest",
    "RequestStream",
    "Runner",
    "TokenEvent",
    "describe_method",
]
