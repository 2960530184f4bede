"""StreamingLLM against a per-head loop written from its definition: S sinks + the W most recent tokens."""

from __future__ import annotations

import pytest

from retopk_core.methods import make_method
from tests.core.baselines._harness import attend, check_against_reference, make_run


def reference_positions(L: int, sinks: int, recent: int) -> list[int]:
    return sorted({i for i in range(L) if i < sinks or i >= L - recent})


@pytest.mark.parametrize("sinks, top_k, H, H_kv, block", [
    (3, 10, 4, 4, None),
    (0, 5, 6, 2, 4),  # no sinks: a pure recent window
    (4, 30, 6, 2, None),  # budget above some lengths: everything attended there
    (2, 7, 4, 4, 3),
])
def test_matches_reference_loop(sinks, top_k, H, H_kv, block):
    # lengths cover L < S + W (everything), L just above, and L far above the budget
    run = make_run(H=H, H_kv=H_kv, prompt_lens=(40, 11, 2), steps=3, seed=3)

    def reference(b, g, L, q, keys, values):
        want = reference_positions(L, sinks, top_k - sinks)
        return want, attend(q, keys, values, want, run.scale), 0  # the fixed selector scores nothing

    check_against_reference(make_method("streaming_llm", top_k=top_k, sinks=sinks), run, block, reference)


def test_paper_setting_is_64_sinks_and_448_recent():
    d = make_method("streaming_llm").describe()
    assert (d["top_k"], d["sinks"], d["recent"]) == (512, 64, 448)


def test_sinks_must_leave_room_for_the_current_token():
    with pytest.raises(ValueError, match="sinks"):
        make_method("streaming_llm", top_k=8, sinks=8)
