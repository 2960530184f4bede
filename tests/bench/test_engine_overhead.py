"""bench/engine_overhead.py's per-step bookkeeping (no model: the Clock alone)."""

from bench import engine_overhead


def test_a_step_files_its_own_parts_not_a_prefills_forward_before_it():
    clock = engine_overhead.Clock(rows=2)
    clock.counting = True
    clock.current["forward"] = 5.0  # a prefill's forward, between two decode steps
    for batch, parts in ((2, {"step": 3.0, "forward": 2.0, "runner": 2.5, "metrics": 0.25}),
                         (1, {"step": 1.0, "forward": 0.5})):  # a step over fewer than M rows is not filed
        clock.begin()
        for part, seconds in parts.items():  # as the wrapped functions add their times
            clock.current[part] += seconds
        clock.end(batch)
    assert len(clock.steps) == 1
    step = clock.steps[0]
    assert step["forward"] == 2.0 and step["outside"] == 1.0  # step less forward
    assert step["runner"] == 0.5 and step["metrics"] == 0.25  # the runner's decode less its forward
