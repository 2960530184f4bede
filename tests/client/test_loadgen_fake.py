"""The load generator end to end against the scripted fake service (fast; the live run is in test_cli_live)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from retopk_client.loadgen import BenchConfig, run_bench
from tests.client.conftest import cli_env
from tests.client.fake_service import FakeServer


@pytest.fixture
def fake():
    server = FakeServer()
    yield server
    server.stop()


def test_request_count_mode_counts_tokens_and_errors_by_code(fake):
    fake.service.failures["Generate"] = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    report = run_bench(BenchConfig(address=fake.address, concurrency=3, requests=7, max_new_tokens=3))
    assert report.requests_sent == 7 and fake.service.count("Generate") == 7  # failures are not retried
    assert report.requests_failed == 2 and report.errors_by_code == {"RESOURCE_EXHAUSTED": 2}
    assert report.requests_ok == 5 and report.generated_tokens == 5 * len(fake.service.tokens)
    assert report.ttft.count == 5 and report.e2e.count == 5
    assert report.itl.count == 5 * (len(fake.service.tokens) - 1)  # one gap per token after the first
    assert report.tokens_per_second == pytest.approx(report.generated_tokens / report.wall_seconds)


def test_duration_mode_stops_sending_after_the_duration(fake):
    fake.service.delay = 0.05
    report = run_bench(BenchConfig(address=fake.address, concurrency=2, duration=0.3, requests=None))
    assert report.requests_ok == report.requests_sent >= 2
    assert report.requests_sent == fake.service.count("Generate")


def test_every_request_carries_the_sampling_and_method_options(fake):
    run_bench(BenchConfig(address=fake.address, concurrency=1, requests=2, max_new_tokens=5,
                          generate_kwargs={"temperature": 0.7, "method": "full"}))
    assert len(fake.service.generate_requests) == 2
    for req in fake.service.generate_requests:
        assert req.max_new_tokens == 5 and req.ignore_eos and req.sampling.temperature == pytest.approx(0.7)
        assert req.method.name == "full" and req.chat.messages[0].role == "user"


def test_report_states_the_sampling_and_accounts_logprobs(fake):
    report = run_bench(BenchConfig(address=fake.address, concurrency=2, requests=4, max_new_tokens=3,
                                   generate_kwargs={"temperature": 0.0, "logprobs": True}))
    assert all(req.logprobs for req in fake.service.generate_requests)
    assert report.sampling == {"temperature": 0.0}
    assert report.logprob_tokens == 4 * 3 and report.mean_logprob == pytest.approx((-0.5 - 1.0 - 1.5) / 3)
    table = report.format_table()
    assert "sampling temperature=0.0" in table and "logprobs  12 tokens, mean -1.000" in table


def test_cli_bench_prints_a_table(fake):
    done = subprocess.run(
        [sys.executable, "-m", "retopk_client.cli", "bench", "--address", fake.address, "-n", "2", "--requests", "4"],
        capture_output=True, text=True, timeout=120, env=cli_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "tokens/s" in done.stdout and "TTFT (client)" in done.stdout and "inter-token" in done.stdout
    assert "ok 4" in done.stdout and "p99" in done.stdout


def test_cli_bench_exits_1_when_every_request_fails(fake):
    fake.service.failures["Generate"] = [grpc.StatusCode.UNAVAILABLE] * 2
    done = subprocess.run(
        [sys.executable, "-m", "retopk_client.cli", "bench", "--address", fake.address, "-n", "1", "--requests", "2",
         "--json"],
        capture_output=True, text=True, timeout=120, env=cli_env(),
    )
    assert done.returncode == 1
    assert '"UNAVAILABLE": 2' in done.stdout
