"""Retries of idempotent calls with exponential backoff.

Attempt ``n`` (0-based) that fails with a retryable code waits
``min(max_backoff, initial_backoff * multiplier**n) * (1 + jitter * u)``, ``u`` uniform in [-1, 1],
then tries again, up to ``max_attempts`` attempts in all and never past the call's deadline.
Only idempotent calls go through here (info, health, tokenize, get/list/close session), and
``Generate`` only until its first chunk arrives: a stream that has started is never replayed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from retopk_client.errors import RetopkError, from_rpc_error

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to retry; ``RetryPolicy(max_attempts=1)`` disables retries."""

    max_attempts: int = 4
    initial_backoff: float = 0.1
    max_backoff: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.2
    retry_codes: frozenset[grpc.StatusCode] = field(default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE}))

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        if self.initial_backoff < 0:
            raise ValueError(f"initial_backoff must be >= 0, got {self.initial_backoff!r}")
        if self.max_backoff < self.initial_backoff:
            raise ValueError(f"max_backoff must be >= initial_backoff, got {self.max_backoff!r}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier!r}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"jitter must lie in [0, 1), got {self.jitter!r}")

    def backoff(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (0-based)."""
        base = min(self.max_backoff, self.initial_backoff * self.multiplier**attempt)
        u = (rng or random).uniform(-1.0, 1.0)
        return max(0.0, base * (1.0 + self.jitter * u))

    def should_retry(self, err: RetopkError, attempt: int) -> bool:
        return err.code in self.retry_codes and attempt + 1 < self.max_attempts


class Attempts:
    """The retry state of one call: its deadline and how many attempts have failed so far. ``follow(err)``, when
    given, moves the client to the new home a handoff notice names (True when it did): the call then goes again
    at once, once per call, whatever the policy (the server refused it before running anything)."""

    def __init__(self, policy: RetryPolicy, timeout: float | None,
                 follow: Callable[[RetopkError], bool] | None = None) -> None:
        self.policy = policy
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.failed = 0
        self.follow = follow

    def left(self) -> float | None:
        """Seconds left before the deadline, or None for no deadline."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def delay_after(self, err: RetopkError) -> float | None:
        """Seconds to wait before retrying after ``err``, or None when it must be raised instead."""
        if self.follow is not None and self.follow(err):
            self.follow = None  # once
            return 0.0
        delay = self.policy.backoff(self.failed)
        left = self.left()
        if not self.policy.should_retry(err, self.failed) or (left is not None and left <= delay):
            return None
        self.failed += 1
        return delay


def call_with_retry(
    fn: Callable[[float | None], T],
    policy: RetryPolicy,
    timeout: float | None,
    sleep: Callable[[float], None] = time.sleep,
    follow: Callable[[RetopkError], bool] | None = None,
) -> T:
    """Run ``fn(timeout_left)``; on a retryable ``grpc.RpcError`` back off and retry (on a handoff notice that
    ``follow`` takes: at once, see ``Attempts``).

    Every failure leaves as a typed ``RetopkError``; the last attempt's error is the one raised.
    """
    attempts = Attempts(policy, timeout, follow)
    while True:
        try:
            return fn(attempts.left())
        except grpc.RpcError as rpc_err:
            err = from_rpc_error(rpc_err)
        delay = attempts.delay_after(err)
        if delay is None:
            raise err
        sleep(delay)


async def acall_with_retry(
    fn: Callable[[float | None], Awaitable[T]],
    policy: RetryPolicy,
    timeout: float | None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    follow: Callable[[RetopkError], bool] | None = None,
) -> T:
    """The asyncio twin of ``call_with_retry``."""
    attempts = Attempts(policy, timeout, follow)
    while True:
        try:
            return await fn(attempts.left())
        except grpc.RpcError as rpc_err:
            err = from_rpc_error(rpc_err)
        delay = attempts.delay_after(err)
        if delay is None:
            raise err
        await sleep(delay)
