"""bench/prefill_wave.py on the embedded model (the served weights are what the wave times): `make test-full`."""

import pytest

from bench import prefill_wave


@pytest.mark.full
def test_prefill_wave_prints_every_part_per_activations(capsys):
    med = prefill_wave.main(["--prompts", "2", "--waves", "1", "--rounds", "1"])
    assert list(med) == ["float32"] and list(med["float32"]) == list(prefill_wave.PARTS)
    parts = med["float32"]
    assert all(parts[part] > 0 for part in prefill_wave.PARTS)
    assert parts["wave"] == pytest.approx(parts["open"] + parts["forward"] + parts["close"])  # one wave: its parts
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# prefill_wave: 2 prompts") and lines[2].split()[0] == "float32"
