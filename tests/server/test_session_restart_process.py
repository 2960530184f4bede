"""Real processes (the embedded model, small prompts). A restart with --session-dir: SIGTERM drains the server,
which writes its idle session to the directory and exits 0; a new process on the same directory continues the
session, and its greedy turn equals the same conversation's fourth turn on a session that never stopped. A drain
with --handoff-linger-s: the SDK follows the drained server's notice to the peer, the same session continues.

Both start and stop whole server processes, so they run in `make test-full` only; `make test` holds the same
two behaviours on in-process servers (test_session_transfer_live.py's restart with a session dir,
test_handoff_notice.py's SDK following the notice)."""

from __future__ import annotations

import signal

import pytest

from retopk_client import Client, RetryPolicy
from tests._live_server import launch_server

pytestmark = [pytest.mark.slow, pytest.mark.full, pytest.mark.timeout(900)]

TURNS = [[101, 2000, 345, 46, 7, 890], [12, 13, 14], [5000, 6000], [77, 78, 79, 80]]


def turn(client: Client, session_id: str, ids: list[int]) -> list[int]:
    return list(client.complete(token_ids=ids, session_id=session_id, temperature=0, max_new_tokens=4,
                                ignore_eos=True).token_ids)


def test_a_session_continues_with_identical_greedy_tokens_after_a_process_restart(tmp_path):
    directory = tmp_path / "sessions"
    first = launch_server("--session-dir", str(directory))
    try:
        with Client(first.address, timeout=300) as client:
            client.create_session(session_id="ref")  # the reference: all four turns, never stopped
            reference = [turn(client, "ref", ids) for ids in TURNS]
            reference_tokens = client.close_session("ref").num_tokens
            client.create_session(session_id="kept")
            assert [turn(client, "kept", ids) for ids in TURNS[:3]] == reference[:3]
        assert first.stop() == 0  # SIGTERM: the drain writes "kept"
    finally:
        first.kill()
    assert len(list(directory.iterdir())) == 1

    second = launch_server("--session-dir", str(directory))
    try:
        with Client(second.address, timeout=300) as client:
            assert turn(client, "kept", TURNS[3]) == reference[3]
            info = client.get_session("kept")
            assert info.turns == 4 and info.num_tokens == reference_tokens
    finally:
        second.stop()


def test_a_drained_process_tells_its_sdk_client_where_the_session_went(tmp_path):
    """Two real processes: A (--handoff-peer B --handoff-linger-s) is sent SIGTERM between a session's third and
    fourth turns; the SDK, which knows B's address, gets A's notice and runs the fourth turn on B in the same
    session: its greedy tokens and token count equal the never-moved conversation's, and A exits 0."""
    b = launch_server()
    try:
        a = launch_server("--handoff-peer", b.address, "--handoff-linger-s", "20", "--drain-grace-s", "0")
        try:
            with Client(a.address, timeout=300) as client:
                client.create_session(session_id="ref")
                reference = [turn(client, "ref", ids) for ids in TURNS]
                reference_tokens = client.close_session("ref").num_tokens
                client.create_session(session_id="kept")
                assert [turn(client, "kept", ids) for ids in TURNS[:3]] == reference[:3]
            a.process.send_signal(signal.SIGTERM)
            patient = RetryPolicy(max_attempts=60, initial_backoff=0.2, max_backoff=1.0)  # while A hands it over
            with Client(a.address, timeout=300, retry=patient, handoff_addresses=[b.address]) as client:
                assert turn(client, "kept", TURNS[3]) == reference[3]
                assert client.config.address == b.address
                info = client.get_session("kept")
                assert info.turns == 4 and info.num_tokens == reference_tokens  # the same session, nothing replayed
            assert a.process.wait(120) == 0
            assert "1 sessions handed over" in a.output()
        finally:
            a.kill()
    finally:
        b.stop()
