"""bench/prefill_wave.py on the embedded model (the served weights are what the wave times): `make test-full`."""

import pytest

from bench import prefill_wave


def _served_activations() -> str:
    """What the server's default activations (auto) are on the embedded model's int4 blocks: bf16x2 with AMX, int16
    with AVX-512 VNNI."""
    from retopk_server.runtime.decoder.llama import cpu_activations

    return cpu_activations()[0]


@pytest.mark.full
def test_prefill_wave_prints_every_part_per_activations(capsys):
    """By default the server's activations, labelled with what auto resolved to."""
    med = prefill_wave.main(["--prompts", "2", "--waves", "1", "--rounds", "1"])
    act = _served_activations()
    assert list(med) == [act] and list(med[act]) == list(prefill_wave.PARTS)
    parts = med[act]
    assert all(parts[part] > 0 for part in prefill_wave.PARTS)
    assert parts["wave"] == pytest.approx(parts["open"] + parts["forward"] + parts["close"])  # one wave: its parts
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# prefill_wave: 2 prompts") and lines[2].split()[0] == act


@pytest.mark.full
def test_prefill_wave_times_auto_once_beside_what_it_resolves_to():
    med = prefill_wave.main(["--prompts", "1", "--waves", "1", "--rounds", "1", "--activations", "auto", "int8",
                             _served_activations()])
    assert list(med) == [_served_activations(), "int8"]


@pytest.mark.full
def test_prefill_wave_on_two_threads_adds_wall_and_all_threads_cpu(capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        med = prefill_wave.main(["--prompts", "2", "--waves", "1", "--rounds", "1", "--threads", "2",
                                 "--activations", "float32"])
    finally:
        torch.set_num_threads(threads)
    parts = med["float32"]
    assert list(parts)[:len(prefill_wave.PARTS)] == list(prefill_wave.PARTS)
    for part in prefill_wave.WHOLE:
        assert parts[f"{part} main"] == parts[part] and parts[f"{part} all"] >= parts[part] > 0
        assert parts[f"{part} wall"] > 0
        assert parts[f"{part} alone"] == pytest.approx(2 * parts[part] - parts[f"{part} all"])  # one wave each
    lines = capsys.readouterr().out.splitlines()
    assert "2 thread(s)" in lines[0] and lines[3].split()[:2] == ["activations", "forward"]


@pytest.mark.full
def test_prefill_wave_takes_turns_with_and_without_the_split_products(capsys):
    from retopk_server.runtime.decoder import linear

    med = prefill_wave.main(["--prompts", "2", "--waves", "1", "--rounds", "1", "--split-rows", "on", "off",
                             "--activations", "float32"])
    assert list(med) == ["float32/on", "float32/off"] and linear.SPLIT_ROWS == 32  # the rule is back as it was
    assert all(parts["forward"] > 0 for parts in med.values())
