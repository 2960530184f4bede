"""zlib's CRC-32 of a large buffer, its parts on several threads: the result equals ``zlib.crc32`` of the whole.

A saved session's load checks its file's CRC-32 (engine/session_file.py) before anything reads it, in the first
turn of a client coming back after a restart. Each part is hashed by ISA-L's CRC-32 (the ``isal`` package,
``isal_zlib.crc32``: the same polynomial, register and result as zlib's, folded with carry-less multiplications)
where it is installed, else by zlib's, whose table-driven pass is several times slower on a CPU with PCLMULQDQ.
Both release the GIL for a large buffer, so the parts run at once, and ``combine`` joins their CRCs as zlib's
``crc32_combine`` does (Python's zlib does not expose it). Over GF(2), with the CRC's bits reflected and its
register pre- and post-inverted as zlib keeps it, the CRC of A followed by B is

    crc(A || B) = crc(A) * x^(8 |B|)  mod P  XOR  crc(B)        P: the CRC-32 polynomial (0xedb88320 reflected)

``x^(8 |B|) mod P`` comes from the table of x^(2^k) mod P by square-and-multiply: a few dozen 32-bit
multiplications, whatever the length.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor, wait

try:
    from isal.isal_zlib import crc32 as part_crc32  # ISA-L's: the same number as zlib's (module docstring)
except ImportError:  # an install without it
    from zlib import crc32 as part_crc32

POLY = 0xEDB88320  # the CRC-32 polynomial, bits reflected (x^0 is bit 31)
MIN_PART = 1 << 20  # the smallest piece: a smaller buffer is hashed on the calling thread alone
MAX_PARTS = 4
CHUNKS_PER_THREAD = 4


def _multiply(a: int, b: int) -> int:
    """a * b mod P, both reflected polynomials of degree < 32 (zlib's multmodp)."""
    m, p = 1 << 31, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


def _powers() -> list[int]:
    """x^(2^k) mod P for k = 0 .. 31 (zlib's x2n_table)."""
    table, p = [], 1 << 30  # x^1
    for _ in range(32):
        table.append(p)
        p = _multiply(p, p)
    return table


X2N = _powers()


def _shift(n: int) -> int:
    """x^(8 n) mod P (zlib's x2nmodp(n, 3)): the factor that moves a CRC past n zero bytes."""
    p, k = 1 << 31, 3  # x^0
    while n:
        if n & 1:
            p = _multiply(X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A || B from crc1 = crc(A), crc2 = crc(B) and len2 = |B| in bytes (module docstring)."""
    return _multiply(_shift(len2), crc1) ^ crc2


_pool: ThreadPoolExecutor | None = None


def max_parts() -> int:
    """How many threads hash a large buffer: MAX_PARTS, or as many CPUs as this process may run on if fewer."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_PARTS, cpus))


def crc32(data, value: int = 0) -> int:
    """``zlib.crc32(data, value)`` of a buffer (bytes, a memoryview of a mapped file) on up to ``max_parts()``
    threads, this one among them. The buffer is cut in CHUNKS_PER_THREAD pieces a thread (of at least MIN_PART
    bytes) that the threads take in turn, so that a thread the CPUs are busy elsewhere for holds up at most the
    piece it has: on a loaded machine this thread hashes the rest itself."""
    global _pool
    with memoryview(data).cast("B") as view:
        n = len(view)
        threads = min(max_parts(), n // MIN_PART)
        if threads <= 1:
            return part_crc32(view, value)
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_PARTS - 1, thread_name_prefix="retopk-crc")
        pieces = min(threads * CHUNKS_PER_THREAD, n // MIN_PART)
        bounds = [n * i // pieces for i in range(pieces + 1)]
        views = [view[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        crcs = [0] * pieces
        turn = itertools.count()  # next() is atomic under the GIL: each piece goes to one thread

        def take_pieces() -> None:
            while (i := next(turn)) < pieces:
                crcs[i] = part_crc32(views[i])

        helpers = [_pool.submit(take_pieces) for _ in range(threads - 1)]
        try:
            take_pieces()
        finally:
            wait(helpers)  # no thread reads the buffer once this returns: its owner may close it (a mapped file)
            for v in views:
                v.release()
        for future in helpers:
            future.result()
    crc = value
    for (a, b), piece in zip(zip(bounds, bounds[1:], strict=False), crcs, strict=True):
        crc = combine(crc, piece, b - a)
    return crc
