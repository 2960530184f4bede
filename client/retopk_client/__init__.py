"""retopk client SDK: sync ``Client`` and asyncio ``AsyncClient`` for the retopk gRPC decoding server.

Needs only grpcio and protobuf (no torch). See ``retopk_client.client`` for a usage example and
``retopk --help`` for the command line.
"""

from retopk_client.aio import AsyncClient, AsyncGenerateStream, AsyncSession
from retopk_client.channel import ClientConfig
from retopk_client.client import Client, GenerateStream, Session
from retopk_client.errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    RetopkError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from retopk_client.retry import RetryPolicy
from retopk_client.types import (
    ChatMessage,
    Chunk,
    Completion,
    Constraint,
    FinishReason,
    Limits,
    Method,
    ModelInfo,
    Sampling,
    ServerStatus,
    SessionInfo,
    StepStats,
    Timings,
    Tokenized,
    TokenLogprob,
    Tool,
    ToolCall,
    TopLogprob,
    Usage,
)

__all__ = [
    "Aborted", "AlreadyExists", "AsyncClient", "AsyncGenerateStream", "AsyncSession", "Cancelled", "ChatMessage",
    "Chunk", "Client", "ClientConfig", "Completion", "Constraint", "DeadlineExceeded", "FailedPrecondition",
    "FinishReason", "GenerateStream", "InternalError", "InvalidArgument", "Limits", "Method", "ModelInfo", "NotFound",
    "OutOfRange", "PermissionDenied", "ResourceExhausted", "RetopkError", "RetryPolicy", "Sampling", "ServerStatus",
    "Session", "SessionInfo", "StepStats", "Timings", "Tokenized", "TokenLogprob", "Tool", "ToolCall", "TopLogprob",
    "Unauthenticated", "Unavailable", "Unimplemented", "Usage",
]
__version__ = "0.1.0"
