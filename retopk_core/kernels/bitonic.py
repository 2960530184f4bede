"""In-register bitonic sort and Top-K of a 1-D power-of-two block, plus the (score, position) sort key.

The network is triton's own (``triton.language.standard.sort_impl``: bitonic stages on the block
viewed as a {2}^n hypercube, then the bitonic Top-K reduction of Shanbhag et al.); only the
compare-and-swap differs: it takes min / max over the size-2 axis instead of an XOR reduction. The
result is identical and compiles to the same data movement, and it is much cheaper under TRITON_INTERPRET
(where an XOR reduction is evaluated element by element).

Sort key of a scored position (to sort scores together with their positions in one int64):
    key(s, i) = ord(s) * 2^32 + (2^31 - 1 - i)
where ord(s) is the float32 bit pattern made monotone as a signed int32 (negative floats have their
magnitude bits flipped). key is increasing in s, and among equal scores the smaller position ranks
higher. EMPTY = INT64_MIN ranks below every real key and marks padding.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.standard import _elementwise_max, _elementwise_min, _log2
from triton.runtime.jit import constexpr_function

# Globals read inside @jit code must be tl.constexpr (the compiler rejects plain ints; the interpreter doesn't).
EMPTY = tl.constexpr(-(2**63))  # sort key of a padding slot (below every real key); host value: EMPTY.value
POS_PAD = tl.constexpr(2**31 - 1)  # int32 padding position (sorts after every real position)


@constexpr_function
def _one_hot_shape(n_dims, axis_from_minor):
    """Shape [1, .., 2, .., 1] of n_dims dims with the 2 at position ``axis_from_minor`` from the end."""
    return [1] * (n_dims - axis_from_minor - 1) + [2] + [1] * axis_from_minor


@constexpr_function
def _min(a, b):
    return min(a, b)


@constexpr_function
def _runs_stage(i, log_k, sorted_runs, skip):
    """Whether stage i runs: not the first ``skip`` (their runs are given sorted), and with sorted input
    runs of K only the merging ones (i > log K)."""
    return i > skip and (i > log_k or not sorted_runs)


@triton.jit
def bitonic_topk(x, K: tl.constexpr, DESCENDING: tl.constexpr, SORTED_RUNS: tl.constexpr = False,
                 SKIP: tl.constexpr = 0):
    """The K largest (DESCENDING) or smallest entries of a 1-D block x, sorted; K and len(x) powers of 2,
    2 <= K <= len(x).

    SORTED_RUNS (K < len(x)): x is already made of runs of K sorted the way the network's stage log K
    leaves them, run r ascending when r is even and descending when r is odd (``sorted_run_index``). The
    stages that sort the runs are then skipped and only the log(len(x) / K) merging ones run (each: keep
    the elementwise better of a run pair, a bitonic top K, then log K half-cleaner steps), e.g. 20 of
    the 65 compare-exchange rounds for 4 sorted lists of 512. SKIP (K = len(x), a full sort): the first
    SKIP stages are skipped, x being made of runs of 2^SKIP sorted that way (``bitonic_merge_sort``).

    Written as one function calling only builtins (tl.reduce with triton's own min/max combiners, as
    tl.min / tl.max do): the interpreter re-patches triton.language on every nested jit call, which
    would dominate its run time. Stage i merges bitonic runs of 2^min(i, log K); its steps compare
    partners along successively lower hypercube axes; ``flip`` alternates the direction of the runs.
    Loop-local constants are inline constexpr expressions (the compiler forbids re-assigned constexprs).
    """
    log_n: tl.constexpr = _log2(x.shape[0])
    log_k: tl.constexpr = _log2(K)
    h = tl.reshape(x, [2] * log_n)
    for i in tl.static_range(1, log_n + 1):
        if _runs_stage(i, log_k, SORTED_RUNS, SKIP):
            if i > log_k:  # bitonic Top-K: keep the better half of each pair of 2^log_k runs
                if DESCENDING:
                    h = tl.reduce(h, _log2(h.numel) - 1 - log_k, _elementwise_max)
                else:
                    h = tl.reduce(h, _log2(h.numel) - 1 - log_k, _elementwise_min)
            if i < log_n:
                flip = tl.reshape(tl.arange(0, 2), _one_hot_shape(_log2(h.numel), _min(i, log_k)))
            else:
                flip = DESCENDING
            for jj in tl.static_range(_min(i, log_k)):
                lo = tl.reduce(h, _log2(h.numel) - _min(i, log_k) + jj, _elementwise_min, keep_dims=True)
                hi = tl.reduce(h, _log2(h.numel) - _min(i, log_k) + jj, _elementwise_max, keep_dims=True)
                is_right = tl.reshape(tl.arange(0, 2), _one_hot_shape(_log2(h.numel), _min(i, log_k) - 1 - jj))
                h = tl.where((flip ^ is_right).to(tl.int1), hi, lo)
    return tl.reshape(h, [K])


@triton.jit
def sorted_run_index(i, K: tl.constexpr):
    """Where slot i of a SORTED_RUNS block reads from K-long lists sorted best first (descending): run
    r = i // K is list r, read back to front when r is even (ascending), front to back when odd."""
    w = i % K
    return (i // K) * K + tl.where((i // K) % 2 == 0, K - 1 - w, w)


@triton.jit
def bitonic_sort(x):
    """x (1-D, power-of-two length >= 2) sorted ascending."""
    return bitonic_topk(x, x.shape[0], False)


@triton.jit
def bitonic_merge_sort(x, RUN: tl.constexpr):
    """x (1-D, power-of-two length n >= 2) sorted ascending, given that x is made of runs of RUN (a power
    of two <= n) each sorted the way the network's stage log RUN leaves them: run r ascending when r is
    even, descending when odd. Only the merging stages log RUN + 1 .. log n run (a full sort runs stages
    1 .. log n, stage i having i compare-exchange steps): 21 of 66 steps for 4 runs of 512. A run not
    sorted that way gives a wrong result, not an error: callers check their runs first."""
    return bitonic_topk(x, x.shape[0], False, False, _log2(RUN))


@triton.jit
def pack_key(score, pos):
    """int64 sort key of float32 scores and int positions (0 <= pos < 2^31), see the module docstring."""
    s = score.to(tl.int32, bitcast=True)
    s = tl.where(s < 0, s ^ 0x7FFFFFFF, s)
    return (s.to(tl.int64) << 32) | (0x7FFFFFFF - pos.to(tl.int32)).to(tl.int64)


@triton.jit
def unpack_pos(key):
    """Position of a sort key (int64); meaningless for EMPTY."""
    return 0x7FFFFFFF - (key - ((key >> 32) << 32))


@triton.jit
def unpack_score(key):
    """float32 score of a sort key; meaningless for EMPTY."""
    s = (key >> 32).to(tl.int32)
    s = tl.where(s < 0, s ^ 0x7FFFFFFF, s)
    return s.to(tl.float32, bitcast=True)


def next_pow2(n: int, minimum: int = 2) -> int:
    return max(minimum, triton.next_power_of_2(int(n)))
