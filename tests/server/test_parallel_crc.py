"""engine/parallel_crc.py: the CRC-32 of a buffer computed in parts on several threads equals zlib's of the whole,
with either primitive (ISA-L's where installed, zlib's), and a mapped file's buffer can be closed once it returns."""

from __future__ import annotations

import mmap
import os
import random
import zlib

import pytest

from retopk_server.engine import parallel_crc


@pytest.mark.parametrize("first, second", [(0, 0), (1, 0), (0, 1), (3, 7), (1000, 12345), (70_000, 1 << 17)])
def test_combine_gives_the_crc_of_the_concatenation(first, second):
    rng = random.Random(first * 31 + second)
    a, b = rng.randbytes(first), rng.randbytes(second)
    assert parallel_crc.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    seeded = zlib.crc32(a, 0xDEADBEEF)  # a CRC continued from an earlier one combines the same way
    assert parallel_crc.combine(seeded, zlib.crc32(b), len(b)) == zlib.crc32(a + b, 0xDEADBEEF)


def primitives() -> list:
    """zlib's CRC-32, and ISA-L's where the isal package is installed."""
    found = [zlib.crc32]
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return found
    return [*found, crc32]


def test_isal_hashes_the_parts_where_it_is_installed():
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert parallel_crc.part_crc32 is isal_zlib.crc32


@pytest.mark.parametrize("primitive", primitives(), ids=lambda f: f.__module__)
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
@pytest.mark.parametrize("size", [0, 4095, 40_001])
def test_the_parts_crc_equals_zlibs_of_the_whole(monkeypatch, primitive, parts, size):
    monkeypatch.setattr(parallel_crc, "part_crc32", primitive)
    monkeypatch.setattr(parallel_crc, "MIN_PART", 1024)
    monkeypatch.setattr(parallel_crc, "max_parts", lambda: parts)
    data = random.Random(size).randbytes(size)
    assert parallel_crc.crc32(data) == zlib.crc32(data)
    assert parallel_crc.crc32(data, 12345) == zlib.crc32(data, 12345)
    flipped = bytearray(data)
    if size:
        flipped[size // 2] ^= 0x10  # a byte flipped in the middle part changes it
        assert parallel_crc.crc32(flipped) != zlib.crc32(data)


def test_a_mapped_file_closes_once_it_returns(tmp_path, monkeypatch):
    monkeypatch.setattr(parallel_crc, "MIN_PART", 1024)
    monkeypatch.setattr(parallel_crc, "max_parts", lambda: 4)
    path = tmp_path / "f"
    path.write_bytes(os.urandom(10_000))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        view = memoryview(m)
        got = parallel_crc.crc32(view[100:])
        view.release()  # BufferError here if a part's view were still held
    assert got == zlib.crc32(path.read_bytes()[100:])
