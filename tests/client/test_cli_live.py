"""The `retopk` command line run as a subprocess against the live server (conftest.live_server)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._live_server import served_weight_format
from tests.client.conftest import cli_env

COMMANDS = ["generate", "chat", "sessions", "sessions list", "sessions show", "sessions create", "sessions close",
            "sessions export", "sessions import",
            "info", "status", "health", "bench"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_answers_help(command):
    done = subprocess.run([sys.executable, "-m", "retopk_client.cli", *command.split(), "--help"],
                          capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: retopk " + command.split()[0])


def test_generate_streams_an_answer_naming_paris(run_cli):
    done = run_cli("generate", "What is the capital of France?", "--max-new-tokens", "10", "--usage",
                   "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "generated" in done.stderr and "ttft" in done.stderr


def test_generate_json_is_one_parseable_summary(run_cli):
    done = run_cli("generate", "Once upon a time", "--raw", "--max-new-tokens", "2", "--ignore-eos",
                   "--method", "retopk", "--method-params", "top_k=16,window=8", "--step-stats", "--json",
                   "--logprobs", "2")
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.strip().splitlines()
    out = json.loads(line)
    assert len(out["token_ids"]) == out["usage"]["generated_tokens"] == 2
    assert out["finish_reason"] == "length" and isinstance(out["text"], str)
    assert out["timings"]["total_seconds"] >= out["timings"]["time_to_first_token_seconds"] >= 0
    # one logprob per token, each with its 2 most likely tokens (sorted), and their mean
    assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"]
    for lp in out["logprobs"]:
        assert lp["logprob"] <= 0 and isinstance(lp["token"], str) and len(lp["top"]) == 2
        assert lp["top"][0]["logprob"] >= lp["top"][1]["logprob"] and lp["top"][0]["logprob"] >= lp["logprob"]
    assert out["mean_logprob"] == pytest.approx(sum(lp["logprob"] for lp in out["logprobs"]) / 2)
    # path statistics summarised: every (layer, head) of every reported step took one known path
    assert 1 <= out["steps"] <= 2
    assert set(out["path_counts"]) <= {"reuse", "fallback", "refresh", "exact", "dense", "approx", "cached",
                                       "promoted"}
    assert sum(out["path_counts"].values()) == out["steps"] * 30 * 9
    # group-read rate over (layer, KV group, step), 30 x 3 a step: each read group holds 1..3 full-read heads
    reads = out["group_read_rate"] * out["steps"] * 30 * 3
    assert reads == pytest.approx(round(reads))
    full_heads = sum(n for p, n in out["path_counts"].items() if p != "reuse")
    assert -(-full_heads // 3) <= round(reads) <= full_heads


def test_server_errors_print_one_line_and_exit_1(run_cli):
    done = run_cli("generate", "Hi", "--temperature", "-1")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr.startswith("retopk: error: INVALID_ARGUMENT:") and "temperature" in done.stderr
    missing = run_cli("sessions", "show", "no-such-session")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_unreachable_server_exits_3():
    done = subprocess.run([sys.executable, "-m", "retopk_client.cli", "health", "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=120, env=cli_env())
    assert done.returncode == 3 and done.stderr.startswith("retopk: error: UNAVAILABLE")


def test_info_and_health(run_cli):
    info = run_cli("info", "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["num_layers"] == 30 and data["num_kv_heads"] == 3 and "retopk" in data["methods"]
    text = run_cli("info")
    assert "LlamaForCausalLM" in text.stdout and "default method" in text.stdout
    assert f"weights         {served_weight_format()} (" in text.stdout and "KV cache float16" in text.stdout
    health = run_cli("health")
    assert health.returncode == 0 and health.stdout.strip() == "SERVING"
    status = run_cli("status", "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["draining"] is False


def test_sessions_create_list_show_close(run_cli):
    created = run_cli("sessions", "create", "--method", "full", "--json")
    assert created.returncode == 0, created.stderr
    sid = json.loads(created.stdout)["session_id"]
    listed = run_cli("sessions", "list", "--json")
    assert sid in {s["session_id"] for s in json.loads(listed.stdout)}
    assert sid in run_cli("sessions", "list").stdout
    shown = run_cli("sessions", "show", sid)
    assert shown.returncode == 0 and sid in shown.stdout and "full" in shown.stdout
    closed = run_cli("sessions", "close", sid)
    assert closed.returncode == 0 and sid in closed.stdout
    assert sid not in {s["session_id"] for s in json.loads(run_cli("sessions", "list", "--json").stdout)}


def test_sessions_export_and_import_move_a_session_through_a_file(run_cli, tmp_path):
    """Exported (closed), imported again: the next turn's greedy tokens equal the same conversation never moved."""
    def turn(sid: str, text: str) -> list[int]:
        done = run_cli("generate", text, "--session", sid, "--max-new-tokens", "4", "--temperature", "0",
                       "--ignore-eos", "--raw", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["token_ids"]

    for sid in ("moving", "staying"):
        assert run_cli("sessions", "create", "--session-id", sid, "--method", "full").returncode == 0
        turn(sid, "The river runs")
    path = tmp_path / "moving.session"
    out = run_cli("sessions", "export", "moving", "-o", str(path), "--close", "--progress")
    assert out.returncode == 0, out.stderr
    assert "exported" in out.stderr and "MiB" in out.stderr and f"to {path}" in out.stdout
    # the file is a session file, format 3 (engine/session_file.py): 8 bytes of header length, then its check
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_bytes()[8:].startswith(b'{"__metadata__":{"retopk_check"')
    assert run_cli("sessions", "show", "moving").returncode == 1  # closed: it moved into the file
    back = run_cli("sessions", "import", str(path), "--json", "--progress")
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["session_id"] == "moving" and "imported" in back.stderr
    assert turn("moving", " and then") == turn("staying", " and then")
    for sid in ("moving", "staying"):
        run_cli("sessions", "close", sid)

    missing = run_cli("sessions", "import", str(tmp_path / "nothing.session"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    (tmp_path / "bad.session").write_bytes(b"GARBAGE" * 10)
    bad = run_cli("sessions", "import", str(tmp_path / "bad.session"), "--quiet")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "not a retopk session artifact" in bad.stderr
    nowhere = run_cli("sessions", "export", "staying", "-o", str(tmp_path / "no" / "dir" / "x"))
    assert nowhere.returncode == 2 and "--output" in nowhere.stderr


def test_chat_is_scriptable_through_stdin_and_closes_its_session(run_cli):
    script = "Hello there\n/frobnicate now\n/info\nHow are you?\n/exit\nnever sent\n"
    done = run_cli("chat", "--max-new-tokens", "2", "--method", "full", "--json", input=script)
    assert done.returncode == 0, done.stderr
    assert "unknown command '/frobnicate' (not sent)" in done.stderr
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    first, info, second = lines  # reply, /info, reply; the unknown command was not sent; nothing after /exit
    assert first["usage"]["generated_tokens"] == 2 and second["usage"]["generated_tokens"] == 2
    assert info["turns"] == 1 and info["session_id"] == first["session_id"] == second["session_id"]
    assert second["usage"]["session_tokens"] > first["usage"]["session_tokens"]  # same session grew
    listed = json.loads(run_cli("sessions", "list", "--json").stdout)
    assert first["session_id"] not in {s["session_id"] for s in listed}


def test_bench_reports_throughput_latency_and_errors(run_cli):
    done = run_cli("bench", "-n", "2", "--requests", "2", "--max-new-tokens", "2", "--method", "full", "--json")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert r["requests_sent"] == 2 and r["requests_ok"] + r["requests_failed"] == 2
    assert r["requests_failed"] == sum(r["errors_by_code"].values())
    assert r["generated_tokens"] == 2 * r["requests_ok"]  # ignore_eos: exactly max_new_tokens each
    assert r["tokens_per_second"] == pytest.approx(r["generated_tokens"] / r["wall_seconds"])
    assert r["ttft"]["count"] == r["requests_ok"]
    assert r["itl"]["count"] <= r["generated_tokens"] - r["requests_ok"]
    for key in ("ttft", "itl", "e2e"):
        s = r[key]
        if s["count"]:
            assert 0 <= s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert r["e2e"]["max_ms"] >= r["ttft"]["max_ms"]


def test_bench_refuses_a_remote_address(run_cli):
    done = run_cli("bench", "--address", "10.1.2.3:50051", "--requests", "1")
    assert done.returncode == 2 and "loopback" in done.stderr
