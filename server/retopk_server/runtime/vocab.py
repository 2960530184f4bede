"""The one rule that token ids belong to the model's vocabulary: service/wire.py refuses ids that break it
(INVALID_ARGUMENT naming the field), the runner asserts it (runtime/runner.py), session imports check it."""

from __future__ import annotations

from collections.abc import Iterable


def first_bad_token(ids: Iterable[int], vocab_size: int) -> int | None:
    """Index of the first id outside [0, vocab_size), or None when every id is a token id."""
    return next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)


def not_a_token(ids, index: int, vocab_size: int) -> str:
    """The message for ``ids[index]``, e.g. "256 is not a token id (vocab_size 256)"."""
    return f"{ids[index]} is not a token id (vocab_size {vocab_size})"
