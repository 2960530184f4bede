"""Triton kernels of the core (the GPU path, ``backend="triton"``).

Nothing here imports triton at package import time: the method modules import
``retopk_core.kernels.triton_launch`` lazily inside ``decode``, and ``launch`` imports the kernel modules,
so ``TRITON_INTERPRET=1`` can still be set before the first kernel is defined (CPU tests).

Kernel files (each holds ``@triton.jit`` code and a thin launcher that checks its inputs):
    bitonic.py        in-register bitonic sort / Top-K and the (score, position) -> int64 sort key
    paged.py          pool-row address of (sequence, KV head, position) in the PagedKV block pool
    dense.py          Full attention: split-K decode over the sequence + log-sum-exp merge
    exact_support.py  full-history QK scores, per-chunk Top-K, Top-K merge tree (exact/fallback/refresh),
                      persistent grids over a work list of the step's exact heads built on the device
    selector.py       ReTopK stage 1: cosine recall, path decision, sorted unique candidate list (sorts the
                      recalled supports only; the window is appended)
    indexed_qk.py     ReTopK stage 2: exact scores of the packed candidates, keys read by index
    select_attend.py  stage 3: Top-K of the path's scores, softmax, indexed value sum, FIFO write + counters
    workspace_cache.py which Workspace (retopk_core/workspace.py) a launcher takes its scratch from
    triton_launch.py  the three entry points the methods call (dense, exact Top-K, ReTopK)
    compile_check.py  compiles every kernel for a CUDA target without a GPU (catches compiler-only errors)
"""
