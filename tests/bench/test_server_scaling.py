"""bench/server_scaling.py against the shared live server at a tiny size (structure, no timings)."""

import json
import os
import time

import pytest

from bench import server_scaling


def test_scaling_rows_count_every_token(live_server, tmp_path, capsys):
    out = tmp_path / "scaling"
    rows = server_scaling.main(["--address", live_server, "--concurrency", "1", "3", "--requests-per-stream", "1",
                                "--max-new-tokens", "4", "--out", str(out)])
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["requests_failed"] == 0
        assert r["generated_tokens"] == r["concurrency"] * 4  # ignore_eos: exactly max_new_tokens each
    assert rows[0]["vs_first"] == 1.0
    assert json.loads(out.with_suffix(".json").read_text())[1]["concurrency"] == 3
    assert "| 3 |" in capsys.readouterr().out


def test_process_cpu_seconds_equal_this_process_cpu_clock():
    """/proc's user + system time of this process equals its own CPU clock (time.process_time) within the two
    clock ticks /proc rounds each of them down to."""
    sum(i * i for i in range(200_000))  # some CPU time to read
    before = time.process_time()
    proc = server_scaling.process_cpu_seconds(os.getpid())
    after = time.process_time()
    if proc is None:
        pytest.skip("no /proc on this system")
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert before - 2 * tick <= proc <= after


def test_client_cpu_is_this_process_cpu_over_the_level(live_server):
    """A level's client CPU is this process's CPU clock over it (bounded by the clock over run(), which a wall
    clock, waiting for the server in its own process, would exceed), per generated token as well."""
    args = server_scaling.parse_args(["--address", live_server, "--concurrency", "1", "--requests-per-stream", "2",
                                      "--max-new-tokens", "8"])
    cpu = time.process_time()
    row, = server_scaling.run(live_server, args)
    cpu = time.process_time() - cpu
    assert 0 < row["client_cpu_s"] <= cpu
    assert row["generated_tokens"] == 16
    assert row["client_cpu_ms_per_token"] == pytest.approx(1e3 * row["client_cpu_s"] / 16)
