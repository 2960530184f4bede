"""The engine: one thread that owns the model runner and runs continuous batching, by composition.

    engine.py           Engine: the facade (submission, lifecycle, drain); builds the parts below
    scheduler.py        Scheduler: the queue, the request being admitted, the batch, each iteration's StepPlan
    loop.py             EngineLoop: the engine thread's loop and its step (plan, prefill, reserve, decode)
    admission.py        Admission: a request's session opened, its prompt fed in chunks, its first token
    delivery.py         Delivery: each row's token sampled and streamed, a request finished or failed
    supervision.py      Supervision: wraps the loop; a loop that dies or hangs (the watchdog) fails the engine
    faults.py           what a failure ends (one request or the engine), the statuses it gets
    commands.py         EngineCommands (sessions, tokenizer, status as futures) over the CommandQueue
    runner_protocol.py  Runner: what the engine asks of a model runner (runtime.ModelRunner implements it)
    session_table.py    SessionTable: named and ephemeral sessions (SessionRecord), their commands and snapshots
    turn.py             ActiveRequest: one request's input tokens (chat re-render diff), stop/finish, timings
    requests.py         what a Generate call asks for, what comes back (events), error codes
    observer.py         EngineObserver: no-op hooks the metrics module overrides
    stream.py           RequestStream: hands events from the engine thread to an asyncio consumer
"""

from retopk_server.engine.engine import Engine
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
from retopk_server.engine.session_table import describe_method
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
