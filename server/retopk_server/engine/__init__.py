"""The engine: one thread that owns the model runner and runs the continuous-batching scheduler.

    requests.py   what a Generate call asks for, what comes back (events), error codes
    observer.py   EngineObserver: no-op hooks the metrics module overrides
    stream.py     RequestStream: hands events from the engine thread to an asyncio consumer
    sessions.py   SessionRecord: a runtime session plus the conversation bookkeeping between turns
    scheduler.py  Engine: admission queue, sessions, the decode loop
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
from retopk_server.engine.scheduler import Engine
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
    "TokenEvent",
]
