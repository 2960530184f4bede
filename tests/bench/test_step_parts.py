"""bench/step_parts.py on the embedded model (its block weights are what the parts time): `make test-full`."""

import pytest
import torch

from bench import step_parts
from retopk_server.runtime.decoder.llama import cpu_activations, shown_activations


@pytest.mark.full
def test_step_parts_prints_every_part_at_one_row_and_at_the_batch(capsys):
    med = step_parts.main(["--rows", "2", "--steps", "1", "--warmup", "1", "--rounds", "1"])
    assert list(med) == list(step_parts.PARTS) and all(set(v) == {1, 2} for v in med.values())
    assert all(med[part][m] > 0 for part in ("step", "attn_in", "mlp_out", "lm_head") for m in (1, 2))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == list(step_parts.PARTS)
    # by default the server's activations (auto): bf16x2 on the embedded model's int4 blocks with AMX, int16 with
    # AVX-512 VNNI
    shown = shown_activations(cpu_activations()[0])
    assert lines[0].endswith(f"weights int4, lm_head int8{shown}, one thread")


@pytest.mark.full
def test_step_parts_with_threads_times_the_whole_step_per_activations(capsys):
    before = torch.get_num_threads()
    try:
        med = step_parts.main(["--threads", "2", "--rows", "2", "--steps", "1", "--warmup", "1", "--rounds", "1",
                               "--activations", "float32", "int8"])
    finally:
        torch.set_num_threads(before)
    assert list(med) == ["float32", "int8"] and all(set(t) == {1, 2} for t in med.values())
    assert all(t[m][col] > 0 for t in med.values() for m in (1, 2) for col in step_parts.WALL)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["float32", "int8"]
