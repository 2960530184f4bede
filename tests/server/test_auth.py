"""API keys (service/auth.py) and the per-caller stream quota (service/quota.py), without a server.

The hashes are checked against hashlib's SHA-256 directly; the keys file's grammar, its reload
(an mtime/size change, ``reload()``), a bad file on reload keeping the old keys, and the
``retopk-server hash-key`` line that the file accepts back.
"""

from __future__ import annotations

import hashlib
import io
import logging

import pytest

from retopk_server.cli import hash_key_main
from retopk_server.service.auth import (
    ANONYMOUS,
    Caller,
    KeyRing,
    KeysFileError,
    Unauthenticated,
    generate_key,
    hash_key,
    parse_keys,
)
from retopk_server.service.quota import StreamQuota, TooManyStreams


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write(path, text: str):
    path.write_text(text)
    return str(path)


def test_hash_key_is_sha256_hex():
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2 vector
    first, second = generate_key(), generate_key()
    assert first != second and len(first) > 40


def test_parse_keys_lines_comments_and_limits():
    text = f"""# a comment
alice:{sha('a-key')} max_streams=4 max_sessions=8
  bob:{sha('b-key').upper()}   # uppercase hex is fine

ops.team@x:{sha('o-key')} max_sessions=1
"""
    entries = parse_keys(text, "k.txt", {"max_streams": 2, "max_sessions": None})
    assert [e.caller for e in entries] == [Caller("alice", 4, 8), Caller("bob", 2, None), Caller("ops.team@x", 2, 1)]
    assert entries[1].digest == bytes.fromhex(sha("b-key"))


@pytest.mark.parametrize("line, words", [
    ("alice", "NAME:SHA256HEX"),
    (f"al/ice:{'0' * 64}", "NAME:SHA256HEX"),  # "/" would make owner/name session keys ambiguous
    ("alice:my-secret-key", "64 hex digits"),  # the key itself instead of its hash
    (f"alice:{'0' * 64} max_streams=0", "max_streams must be a positive integer"),
    (f"alice:{'0' * 64} max_streams=x", "max_streams must be a positive integer"),
    (f"alice:{'0' * 64} streams=3", "unknown option"),
    (f"alice:{'0' * 64}\nalice:{'1' * 64}", "appears twice"),
    (f"alice:{'0' * 64}\nbob:{'0' * 64}", "also another name's"),
    ("# only a comment\n", "no keys"),
])
def test_bad_keys_files_name_the_line(line, words):
    with pytest.raises(KeysFileError) as info:
        parse_keys(line, "keys.txt")
    assert words in str(info.value) and "keys.txt" in str(info.value)


def test_identify_maps_keys_to_callers_and_refuses_the_rest(tmp_path):
    path = write(tmp_path / "keys", f"alice:{sha('a-key')}\nbob:{sha('b-key')} max_streams=1\n")
    ring = KeyRing(path, max_sessions=5)
    assert ring.enabled and ring.names() == ["alice", "bob"]
    assert ring.identify("Bearer a-key") == Caller("alice", None, 5)
    assert ring.identify(b"bearer  b-key ") == Caller("bob", 1, 5)  # scheme case-insensitive, bytes metadata
    for bad in (None, "", "Bearer", "Bearer ", "Bearer nope", "a-key", "Basic a-key", "Bearer a-key2"):
        with pytest.raises(Unauthenticated) as info:
            ring.identify(bad)
        assert "authorization: Bearer <key>" in str(info.value)


def test_dev_mode_everyone_is_anonymous_and_single_key_is_default(tmp_path):
    assert not KeyRing().enabled and KeyRing().identify(None) == ANONYMOUS
    single = KeyRing(api_key="sekret")
    assert single.identify("Bearer sekret").name == "default"
    with pytest.raises(Unauthenticated):
        single.identify("Bearer other")
    both = KeyRing(write(tmp_path / "k", f"alice:{sha('a')}\n"), "sekret")
    assert both.names() == ["default", "alice"]
    with pytest.raises(KeysFileError, match="--api-key"):
        KeyRing(write(tmp_path / "k2", f"default:{sha('a')}\n"), "sekret")


def test_startup_needs_a_readable_good_file(tmp_path):
    with pytest.raises(KeysFileError, match="cannot read"):
        KeyRing(str(tmp_path / "missing"))
    with pytest.raises(KeysFileError, match="64 hex digits"):
        KeyRing(write(tmp_path / "bad", "alice:plaintext\n"))


def test_a_changed_file_is_picked_up_and_a_bad_one_keeps_the_old_keys(tmp_path, caplog):
    path = tmp_path / "keys"
    ring = KeyRing(write(path, f"alice:{sha('a-key')}\n"), check_interval_s=0)
    assert ring.identify("Bearer a-key").name == "alice"
    write(path, f"carol:{sha('c-key')} max_streams=2\nalice2:{sha('a-key')}\n")  # another size: a change
    assert ring.identify("Bearer c-key") == Caller("carol", 2, None)  # picked up on the next call
    assert ring.identify("Bearer a-key").name == "alice2"  # the key's owner is now alice2
    with caplog.at_level(logging.ERROR, logger="retopk_server.auth"):
        write(path, "carol:not-a-hash-this-time\n")
        assert ring.identify("Bearer c-key").name == "carol"  # kept
        assert ring.reload() is False
    assert "keys file not reloaded" in caplog.text and "64 hex digits" in caplog.text
    path.unlink()
    assert ring.reload() is False and ring.identify("Bearer c-key").name == "carol"
    write(path, f"dave:{sha('d-key')}\n")
    assert ring.reload() is True and ring.names() == ["dave"]
    with pytest.raises(Unauthenticated):
        ring.identify("Bearer c-key")  # removed keys stop working


def test_without_a_check_interval_only_reload_rereads(tmp_path):
    path = tmp_path / "keys"
    ring = KeyRing(write(path, f"alice:{sha('a-key')}\n"), check_interval_s=None)
    write(path, f"bob:{sha('b-key')}\n")
    with pytest.raises(Unauthenticated):
        ring.identify("Bearer b-key")
    assert ring.reload() and ring.identify("Bearer b-key").name == "bob"


def test_hash_key_command_makes_a_line_the_file_accepts(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    assert hash_key_main(["alice", "--max-streams", "3"], stdin=io.StringIO("my-key\n"), stdout=out, stderr=err) == 0
    assert out.getvalue() == f"alice:{sha('my-key')} max_streams=3\n"
    out2 = io.StringIO()
    assert hash_key_main(["bob", "--generate"], stdin=io.StringIO(""), stdout=out2, stderr=err) == 0
    key = err.getvalue().rsplit(" ", 1)[1].strip()
    ring = KeyRing(write(tmp_path / "keys", out.getvalue() + out2.getvalue()))
    assert ring.identify("Bearer my-key") == Caller("alice", 3, None)
    assert ring.identify(f"Bearer {key}").name == "bob"
    assert key not in out2.getvalue()  # only the hash goes to stdout (the file)
    with pytest.raises(SystemExit):
        hash_key_main(["bad/name"], stdin=io.StringIO("k"), stdout=io.StringIO(), stderr=io.StringIO())


def test_stream_quota_counts_per_caller():
    quota, alice, bob = StreamQuota(), Caller("alice", max_streams=2), Caller("bob")
    quota.acquire(alice)
    with quota.stream(alice):
        with pytest.raises(TooManyStreams, match="max_streams 2 per key"):
            quota.acquire(alice)
        for _ in range(5):
            quota.acquire(bob)  # no limit of its own
        assert (quota.open(alice), quota.open(bob)) == (2, 5)
    assert quota.open(alice) == 1
    quota.acquire(alice)
    quota.release(alice), quota.release(alice)
    assert quota.open(alice) == 0


def test_hash_key_help_command_hashes_the_key_end_to_end(tmp_path):
    """The command `retopk-server hash-key --help` shows, pasted into a shell as written, writes the line of
    the key in $KEY (not of a literal "%s" or "%%s")."""
    import os
    import re
    import subprocess
    import sys

    from tests._live_server import REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "server"), str(REPO / "client")]),
           "KEY": "rtk-a b%s-key"}
    shown = subprocess.run([sys.executable, "-m", "retopk_server.cli", "hash-key", "--help"], env=env,
                           capture_output=True, text=True, check=True).stdout
    command = re.search(r"\((printf .*?>> keys\.txt)\)", " ".join(shown.split())).group(1)
    shell = f'retopk-server() {{ "{sys.executable}" -m retopk_server.cli "$@"; }}\n{command}\n'
    subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, check=True)
    assert (tmp_path / "keys.txt").read_text() == f"alice:{sha('rtk-a b%s-key')}\n"


def test_key_share_bounds_a_key_without_limits_of_its_own_and_the_anonymous_owner():
    from retopk_server.cli import config_from
    from retopk_server.config import ServerConfig

    config = config_from(["--max-sessions", "5", "--max-running", "2", "--max-queue", "3"], {})
    assert config.key_share == 0.5 and config.key_limits() == (3, 3)  # half, rounded up
    ring = KeyRing.from_config(config)
    assert ring.identify(None) == Caller("", max_streams=3, max_sessions=3)  # dev mode: the anonymous owner
    assert config_from(["--key-share", "0.25", "--max-sessions", "64"], {}).key_limits() == (20, 16)
    assert config_from([], {"RETOPK_KEY_SHARE": "1"}).key_limits() == (None, None)  # the whole server
    assert config_from(["--max-sessions-per-key", "7"], {}).key_limits() == (40, 7)
    for bad in (0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="key_share"):
            ServerConfig(key_share=bad)
