"""bench/handoff.py, bench/handoff_parts.py and bench/session_restart.py run end to end on the embedded model at toy
sizes (no timing asserted): the moved and the restarted sessions continue, and every figure the reports print is
there."""

from __future__ import annotations

import statistics

import pytest

from bench import handoff, session_restart

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_handoff_reports_the_ratio_and_the_moved_session_continues(embedded_model, tmp_path):
    args = handoff.parse_args(["--tokens", "48", "--rounds", "1", "--warmup", "1", "--threads", "1",
                               "--cache-bytes", str(256 << 20), "--out", str(tmp_path / "h.json")])
    result = handoff.measure(args, *embedded_model)
    assert result["same_tokens"] and result["artifact_bytes"] > 0
    assert result["handoff_over_reprefill"] == result["handoff_s"] / result["reprefill_s"]
    assert (tmp_path / "h.json").is_file()


def test_handoff_parts_times_every_part(embedded_model, tmp_path):
    from bench import handoff_parts

    args = handoff_parts.parse_args(["--tokens", "48", "--rounds", "2", "--threads", "1", "--cache-bytes",
                                     str(256 << 20), "--out", str(tmp_path / "p.json")])
    result = handoff_parts.measure(args, *embedded_model)  # it checks that the transfer counted every byte sent
    assert list(result["parts"]) == ["handoff (keep_sessions; process CPU)", "export", "encode", "frame",
                                     "transfer (process CPU)", "parse", "receive", "finish", "check", "import"]
    assert all(t["cpu_s"] >= 0 and t["wall_s"] > 0 for t in result["parts"].values())
    assert (tmp_path / "p.json").is_file()


@pytest.mark.parametrize("after_preload", [False, True])
def test_session_restart_reports_every_session(embedded_model, after_preload):
    args = session_restart.parse_args(["--sessions", "2", "--tokens", "32", "--threads", "1",
                                       "--cache-bytes", str(256 << 20), *["--after-preload"] * after_preload])
    result = session_restart.measure(args, *embedded_model)
    assert len(result["first_token_after_restart_s"]) == 2 and result["saved_bytes"] > 0
    assert (result["preload_wait_s"] is not None) == after_preload
    turns = result["first_token_uninterrupted_turns_s"]  # A's turn (the uninterrupted figure), B's next turns
    assert [t[0] for t in turns] == result["first_token_uninterrupted_s"] and all(len(t) == 3 for t in turns)
    assert [t[1] for t in turns] == result["first_token_next_turn_s"]
    assert result["worst_ratio_to_session_median"] == max(
        a / statistics.median(t) for a, t in zip(result["first_token_after_restart_s"], turns, strict=True))


def test_kv_growth_times_both_doublings(tmp_path):
    from bench import kv_growth

    result = kv_growth.main(["--layers", "2", "--kv-heads", "1", "--block-size", "4", "--head-dim", "8", "--blocks",
                             "4", "--rounds", "2", "--threads", "1", "--out", str(tmp_path / "g.json")])
    assert len(result["seconds"]["copy"]) == len(result["seconds"]["in_place"]) == 2
    assert (tmp_path / "g.json").is_file()


def test_session_load_times_every_part_of_each_variant(embedded_model, tmp_path):
    from bench import session_load

    args = session_load.parse_args(["--tokens", "40", "--rounds", "2", "--threads", "1", "--out",
                                    str(tmp_path / "l.json")])
    result = session_load.measure(args, *embedded_model)
    sizes = result["file_bytes"]
    assert sizes["zlib, int32 state"] < sizes["zlib, int64 state"]  # the narrowed supports: a smaller file
    for figure in ("seconds", "thread_cpu_seconds"):
        assert all(len(times) == 2 for parts in result[figure].values() for times in parts.values())
    assert (tmp_path / "l.json").is_file()
