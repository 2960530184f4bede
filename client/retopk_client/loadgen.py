"""Load generator behind ``retopk bench``: N concurrent Generate streams against a running server.

Each of ``concurrency`` workers sends one request after another until ``requests`` requests have
been sent in all, or until ``duration`` seconds have passed (requests in flight then finish). Per
request the client measures, on its own clock:

    TTFT  = time of the first chunk carrying a token - time the request was sent
    ITL   = gap between consecutive token-carrying chunks, split evenly over that chunk's tokens
    E2E   = time of the last chunk - time the request was sent

and over the run: throughput = generated tokens / wall time (first send to last completion).
Failed requests are counted by gRPC status code and their latencies are left out. When the requests
ask for log-probabilities (``generate_kwargs`` logprobs=True), the report adds how many tokens carried
one and their mean. The report names the sampling the requests asked for (unset fields: the server's
defaults, ModelInfo.default_sampling; temperature 0 is greedy).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from retopk_client.addresses import DEFAULT_ADDRESS, is_loopback
from retopk_client.aio import AsyncClient
from retopk_client.errors import RetopkError
from retopk_client.retry import RetryPolicy
from retopk_client.stats import LatencySummary
from retopk_client.types import SAMPLING_FIELDS

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class BenchConfig:
    """One load run. Exactly one of ``duration`` (seconds) and ``requests`` (total count) is set.

    ``generate_kwargs`` go to every ``AsyncClient.generate`` call (sampling, method, ...).
    Non-loopback addresses are refused unless ``allow_remote`` is set. ``tls``, ``ca``, ``cert``,
    ``key``: as ``ClientConfig``'s (retopk_client.channel).
    """

    address: str = DEFAULT_ADDRESS
    concurrency: int = 8
    duration: float | None = None
    requests: int | None = 32
    prompt: str = DEFAULT_PROMPT
    chat: bool = True
    max_new_tokens: int = 64
    ignore_eos: bool = True
    api_key: str | None = None
    timeout: float | None = None
    allow_remote: bool = False
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    generate_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency must be an integer >= 1, got {self.concurrency!r}")
        if (self.duration is None) == (self.requests is None):
            raise ValueError("set exactly one of duration and requests")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration!r}")
        if self.requests is not None and (not isinstance(self.requests, int) or self.requests < 1):
            raise ValueError(f"requests must be an integer >= 1, got {self.requests!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if not self.allow_remote and not is_loopback(self.address):
            raise ValueError(
                f"address {self.address!r} is not a loopback address; the load generator only targets this "
                "machine unless allow_remote (--allow-remote) is given"
            )


@dataclass
class RequestResult:
    """What one request did, on the client's clock (seconds)."""

    ok: bool
    tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    error_code: str | None = None
    server_ttft: float | None = None
    logprobs: list[float] = field(default_factory=list)  # the generated tokens' logprobs, when asked for


@dataclass(frozen=True)
class BenchReport:
    """The outcome of a run; ``to_dict`` is the ``--json`` output, ``format_table`` the text one."""

    address: str
    concurrency: int
    max_new_tokens: int
    requests_sent: int
    requests_ok: int
    requests_failed: int
    errors_by_code: dict[str, int]
    generated_tokens: int
    wall_seconds: float
    tokens_per_second: float
    requests_per_second: float
    ttft: LatencySummary
    itl: LatencySummary
    e2e: LatencySummary
    server_ttft: LatencySummary
    sampling: dict[str, Any] = field(default_factory=dict)  # the fields the requests set; the rest: server defaults
    logprob_tokens: int = 0
    mean_logprob: float | None = None

    @classmethod
    def of(cls, config: BenchConfig, results: list[RequestResult], wall: float) -> BenchReport:
        ok = [r for r in results if r.ok]
        tokens = sum(r.tokens for r in ok)
        errors = Counter(r.error_code for r in results if not r.ok)
        logprobs = [lp for r in ok for lp in r.logprobs]
        return cls(
            address=config.address,
            concurrency=config.concurrency,
            max_new_tokens=config.max_new_tokens,
            requests_sent=len(results),
            requests_ok=len(ok),
            requests_failed=len(results) - len(ok),
            errors_by_code=dict(sorted(errors.items())),
            generated_tokens=tokens,
            wall_seconds=wall,
            tokens_per_second=tokens / wall if wall > 0 else 0.0,
            requests_per_second=len(ok) / wall if wall > 0 else 0.0,
            ttft=LatencySummary.of([r.ttft for r in ok if r.ttft is not None]),
            itl=LatencySummary.of([gap for r in ok for gap in r.itl]),
            e2e=LatencySummary.of([r.e2e for r in ok if r.e2e is not None]),
            server_ttft=LatencySummary.of([r.server_ttft for r in ok if r.server_ttft is not None]),
            sampling={k: v for k, v in config.generate_kwargs.items() if k in SAMPLING_FIELDS and v is not None},
            logprob_tokens=len(logprobs),
            mean_logprob=sum(logprobs) / len(logprobs) if logprobs else None,
        )

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not isinstance(v, LatencySummary)}
        out.update({k: v.to_dict() for k, v in self.__dict__.items() if isinstance(v, LatencySummary)})
        return out

    def format_table(self) -> str:
        errors = ", ".join(f"{code}: {n}" for code, n in self.errors_by_code.items())
        errors = f"  ({errors})" if errors else ""
        sampling = ", ".join(f"{k}={v}" for k, v in self.sampling.items()) or "server defaults"
        lines = [
            f"target {self.address}   concurrency {self.concurrency}   max_new_tokens {self.max_new_tokens}   "
            f"sampling {sampling}",
            f"requests  sent {self.requests_sent}  ok {self.requests_ok}  failed {self.requests_failed}{errors}",
            f"tokens    {self.generated_tokens} in {self.wall_seconds:.2f} s  ->  "
            f"{self.tokens_per_second:.1f} tokens/s, {self.requests_per_second:.2f} requests/s",
            "",
            f"{'latency (ms)':<26}{'count':>8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
        ]
        rows = [
            ("TTFT (client)", self.ttft),
            ("TTFT (server)", self.server_ttft),
            ("inter-token", self.itl),
            ("end to end", self.e2e),
        ]
        for name, s in rows:
            nums = "".join(f"{_ms(v):>10}" for v in (s.mean_ms, s.p50_ms, s.p90_ms, s.p99_ms, s.max_ms))
            lines.append(f"{name:<26}{s.count:>8}{nums}")
        if self.mean_logprob is not None:
            lines.append(f"logprobs  {self.logprob_tokens} tokens, mean {self.mean_logprob:.3f}")
        return "\n".join(lines)


def _ms(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN (no samples) prints as "-"


async def _one_request(client: AsyncClient, config: BenchConfig, index: int) -> RequestResult:
    kwargs = dict(config.generate_kwargs)
    if config.chat:
        kwargs["messages"] = [{"role": "user", "content": config.prompt}]
    else:
        kwargs["prompt"] = config.prompt
    sent = time.perf_counter()
    last = None
    result = RequestResult(ok=False)
    try:
        async for chunk in client.generate(
            max_new_tokens=config.max_new_tokens, ignore_eos=config.ignore_eos, request_id=f"bench-{index}", **kwargs
        ):
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                if result.ttft is None:
                    result.ttft = now - sent
                elif last is not None:
                    result.itl.extend([(now - last) / n] * n)
                last = now
                result.tokens += n
            result.logprobs.extend(lp.logprob for lp in chunk.logprobs)
            if chunk.timings is not None:
                result.server_ttft = chunk.timings.time_to_first_token_seconds
        result.e2e = time.perf_counter() - sent
        result.ok = True
    except RetopkError as err:
        result.error_code = err.code.name
    return result


async def run_bench_async(config: BenchConfig) -> BenchReport:
    """Run the load and return its report (see the module docstring for the definitions)."""
    # Requests are not retried: an UNAVAILABLE or RESOURCE_EXHAUSTED is a result to report.
    client = AsyncClient(config.address, api_key=config.api_key, timeout=config.timeout,
                         retry=RetryPolicy(max_attempts=1), tls=config.tls, ca=config.ca, cert=config.cert,
                         key=config.key)
    results: list[RequestResult] = []
    sent = 0
    start = time.perf_counter()
    stop_at = None if config.duration is None else start + config.duration

    def may_send() -> bool:
        if config.requests is not None:
            return sent < config.requests
        return time.perf_counter() < stop_at

    async def worker() -> None:
        nonlocal sent
        while may_send():
            index = sent
            sent += 1
            results.append(await _one_request(client, config, index))

    try:
        await asyncio.gather(*(worker() for _ in range(config.concurrency)))
    finally:
        await client.close()
    return BenchReport.of(config, results, time.perf_counter() - start)


def run_bench(config: BenchConfig) -> BenchReport:
    return asyncio.run(run_bench_async(config))
