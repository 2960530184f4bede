"""bench/kernel_bits.py: a record is reproducible, and the comparison names any output whose bits moved."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import kernel_bits
from retopk_core.cpu import decoder_ops, launch

needs_kernel = pytest.mark.skipif(not launch.available(),
                                  reason="fused CPU kernel not built: run `python -m retopk_core.cpu.build`")
SMALL = kernel_bits.CASES[:1] + kernel_bits.CASES[2:3]  # d 16 and 24, block 16 and 100
ROOT = Path(__file__).resolve().parents[2]
DENSE = tuple(str(t).removeprefix("torch.") for t in kernel_bits.DTYPES)  # the dense outputs' names start so


@needs_kernel
def test_same_build_records_the_same_bits_and_a_moved_bit_is_named(tmp_path, capsys):
    a = kernel_bits.record(SMALL, (torch.bfloat16,))
    assert len(a) == 2 * (3 + 2)  # per case: 3 modes' outputs, 2 Top-K selections
    b = kernel_bits.record(SMALL, (torch.bfloat16,))
    assert kernel_bits.differing(a, b) == []
    name = next(n for n in b if n.endswith("exact out"))
    assert b[name].dtype == torch.float32  # the queries' dtype
    b[name] = b[name].clone()
    b[name].view(-1).view(torch.int32)[0] ^= 1  # the last bit of one element's mantissa
    assert kernel_bits.differing(a, b) == [name]
    del b[name]
    assert kernel_bits.differing(a, b) == [name]  # one record lacks it
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    assert kernel_bits.main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "a.pt")]) == 0
    assert kernel_bits.main(["compare", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 1
    assert name in capsys.readouterr().out


@needs_kernel
@pytest.mark.skipif(not decoder_ops.available() or decoder_ops.best_isa() < 2,
                    reason="no AVX-512: the fused kernel's key scoring has one loop here")
def test_the_avx512_key_scoring_keeps_the_avx2_loops_bits(tmp_path):
    """dot_heads's AVX-512 loop (x86-64-v4 CPUs) and its AVX2 clone, which RETOPK_CPU_ISA=avx2 picks in a fresh
    process, score every key with the same sums in the same order: every output the same bits."""
    path = tmp_path / "avx2.pt"
    env = {**os.environ, "RETOPK_CPU_ISA": "avx2"}
    subprocess.run([sys.executable, "-m", "bench.kernel_bits", "record", str(path)], env=env, check=True,
                   cwd=ROOT, capture_output=True)
    saved = torch.load(path)  # its block products too, at AVX2 alone: not this test's subject
    assert kernel_bits.differing(kernel_bits.record(), {n: t for n, t in saved.items() if n.startswith(DENSE)}) == []


@pytest.mark.skipif(not decoder_ops.available(), reason="the decoder's ops are not built")
def test_block_products_record_every_row_count_of_both_formats_as_each_row_alone():
    """The block products' record at one model shape: the same bits twice, both formats at 1..9 rows at each level
    with float32 and int16 activations, and every batch's first row bit for bit the one-row product of that row (a
    stream's tokens do not depend on its batch, checked at the shapes a step runs); int16's the same at every
    level."""
    shape = [("o", 576, 576, "int4")]
    a = kernel_bits.record_products(shape)
    levels = {n.rsplit(" ", 1)[1] for n in a}
    assert len(a) == 2 * 2 * len(kernel_bits.PRODUCT_ROWS) * len(levels)
    assert kernel_bits.differing(a, kernel_bits.record_products(shape)) == []
    for fmt in ("int4", "int8"):
        for way in ("", "int16 "):
            for level in levels:
                one = a[f"block_matmul {way}o 576x576 {fmt} M1 {level}"]
                for M in kernel_bits.PRODUCT_ROWS:
                    y = a[f"block_matmul {way}o 576x576 {fmt} M{M} {level}"]
                    assert y.shape == (M, 576) and torch.equal(y[:1], one), (way, fmt, M, level)
                    assert not way or torch.equal(y, a[f"block_matmul int16 o 576x576 {fmt} M{M} {min(levels)}"])
