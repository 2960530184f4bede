"""ReTopK at the sizes it runs at (d = 64 / 128, K up to 512, L > 1K) against the paper-equation reference.

The step-by-step comparisons in test_retopk.py run at d <= 32, K <= 64, L < 80, where the reference loop
is cheap. Here a few heads at a model's sizes go through the same comparison (paths, max_sim, selected
sets, candidate counts, outputs) on the torch core, the fused CPU kernel and the Triton kernels (under
Triton's CPU interpreter, in `make test-full`): the reference shares no code with any of them, so this is
what holds the kernels' candidate construction and Top-K at size to the paper rather than to the project's
own torch code. Slow by design; two cases.
"""

from __future__ import annotations

import pytest
import torch

from retopk_core.cpu import launch as cpu_launch
from retopk_core.methods import Path
from tests.core._scenario import make_trace
from tests.core.test_retopk import assert_step_matches_reference, run_both

# (H, H_kv, d, K, C, W, R, T_r, prompt_lens, extra): the embedded model's group shape with the server's
# default K, C, W and tau calibration; a d = 128 model with a large K whose reuse candidates (R supports of
# K and W) leave keys out
SIZES = [
    (6, 2, 64, 64, 128, 128, 4, 5, (1100, 1500), {"tau_calibration": 0.8}),
    (4, 2, 128, 512, 8, 128, 2, 4, (1400, 2100), {}),
]
BACKENDS = ["torch", pytest.param("cpu", marks=pytest.mark.skipif(not cpu_launch.available(),
                                                                   reason="the fused CPU library is not built")),
            # the trace's tensors are on the CPU, which only the interpreter runs Triton on (tests/conftest.py);
            # interpreted, these are the suite's slowest cases, so `make test-full` runs them (make test keeps the
            # Triton kernels against the torch code, tests/core/kernels)
            pytest.param("triton", marks=[pytest.mark.full,
                                          pytest.mark.skipif(torch.cuda.is_available(),
                                                             reason="Triton runs on CPU tensors only interpreted")])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SIZES, ids=["d64-K64-C128", "d128-K512"])
def test_matches_reference_at_model_size(case, backend):
    H, H_kv, d, K, C, W, R, T_r, prompt_lens, extra = case
    cfg = dict(top_k=K, cache_size=C, window=W, recall=R, tau=0.85, refresh_every=T_r, gqa_policy="head",
               dense_below=0, backend=backend, **extra)
    trace = make_trace(B=len(prompt_lens), H=H, H_kv=H_kv, d=d, prompt_lens=prompt_lens, steps=8, T=C + 2,
                       seed=1)
    seen, partial = set(), 0
    for t, (out, rows) in enumerate(run_both(cfg, trace, H, H_kv)):
        seen |= assert_step_matches_reference(out, rows)
        lengths = trace.lengths_at(t)
        partial += sum(path == Path.REUSE and len(cand) < int(lengths[b])
                       for b, row in enumerate(rows) for path, _, cand, _, _ in row)
    assert {Path.REUSE, Path.FALLBACK, Path.REFRESH} <= seen
    assert partial > 0  # reuse steps scored a strict subset of the keys: the candidate union was tested
