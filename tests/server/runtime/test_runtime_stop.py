"""StopChecker: incremental detokenisation, stop token ids and stop strings (held back until decided)."""

from __future__ import annotations

import pytest

from retopk_server.runtime.sampling import StopChecker


class ByteTokenizer:
    """Token id = one UTF-8 byte (0-255); 256 = a special end token that decodes to nothing."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def byte_ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def run(checker: StopChecker, ids: list[int]) -> tuple[list[str], bool]:
    deltas = []
    for t in ids:
        delta, stopped = checker.push(t)
        deltas.append(delta)
        if stopped:
            return deltas, True
    return deltas, False


def test_multibyte_characters_are_emitted_whole():
    text = "héllo wörld ✓"
    checker = StopChecker(ByteTokenizer(), [], [])
    deltas, stopped = run(checker, byte_ids(text))
    assert not stopped and "".join(deltas) + checker.flush() == text
    assert all("\ufffd" not in d for d in deltas)


def test_stop_token_stops_without_emitting_it():
    checker = StopChecker(ByteTokenizer(), [256], [])
    deltas, stopped = run(checker, byte_ids("ok") + [256] + byte_ids("never"))
    assert stopped and "".join(deltas) == "ok" and checker.stop_reason == 256


def test_stop_string_across_tokens_cuts_before_it():
    checker = StopChecker(ByteTokenizer(), [], ["END"])
    deltas, stopped = run(checker, byte_ids("abc EN") + byte_ids("D more"))
    assert stopped and "".join(deltas) == "abc " and checker.stop_reason == "END"


def test_possible_stop_prefix_is_held_then_released():
    checker = StopChecker(ByteTokenizer(), [], ["STOP"])
    out = []
    for t in byte_ids("go STO"):
        out.append(checker.push(t)[0])
    assert "".join(out) == "go "  # "STO" could still become "STOP"
    delta, stopped = checker.push(ord("X"))
    assert not stopped and delta == "STOX"


def test_earliest_of_several_stop_strings_wins():
    checker = StopChecker(ByteTokenizer(), [], ["world", "lo w"])
    deltas, stopped = run(checker, byte_ids("hello world"))
    assert stopped and "".join(deltas) == "hel" and checker.stop_reason == "lo w"


def test_flush_returns_held_text_and_push_after_stop_fails():
    checker = StopChecker(ByteTokenizer(), [256], ["xyz"])
    deltas, _ = run(checker, byte_ids("abx"))
    assert "".join(deltas) == "ab" and checker.flush() == "x"
    checker.push(256)
    with pytest.raises(RuntimeError):
        checker.push(ord("a"))


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop_strings"):
        StopChecker(ByteTokenizer(), [], [""])
