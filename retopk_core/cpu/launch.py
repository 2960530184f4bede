"""The launcher of the fused CPU decode steps (retopk_cpu.cpp): one call per layer for the whole batch.

    retopk_decode(method, q, kv, state, slots, scale) -> StepOutput
    dense_decode(q, kv, scale, top_k=0, exact=False) -> (out, selected or None)
    topk_rows(scores, k) -> (N, k) positions of each row's k largest scores (ReTopK's prefill seeding)

The same step as the torch reference ``ReTopK._sparse_step`` (retopk_core/methods/retopk.py), eq. 6-13
and the GQA policy of ``gqa_paths``, for every (sequence, head) of the batch: similarity to the cached
queries and the path, Top-R recall (or the "recent" ablation), candidates = recalled supports ∪ window
(deduplicated; ``recall_successors``: ∪ each recalled position's successor p + 1 <= L - 1), their exact
scores through the block table, scheduled refreshes at each KV group's phase (``refresh_stagger``) and on every
head while t_dec < 0 (a turn's first ``refresh_first`` steps), Top-K
rerank, softmax-value, and the exact
Top-K over the whole history for the heads whose path is not REUSE (the group's keys read once for all
of them), on those heads the per-head threshold update of ``tau_calibration`` (``state.tau``) and, on the
refresh heads that would have reused, the refresh-period update of ``refresh_guard`` (``state.period``), and on
every exact head that would have reused, the threshold raise of ``tau_guard`` (``state.tau``); then the
FIFO write and the ptr / fill / step advance of ``state``. The source's header
states the math. The kernel's entry checks shapes, strides, dtypes and devices and raises ValueError
naming the culprit; this launcher only passes the config along.

``dense_decode`` is Full attention (``dense_attend``), Full attention with each head's Top-K of the same
scores (``dense_attend_topk``: ReTopK's dense floor), or Exact Top-K attention (``exact_select`` +
``sparse_attend``), every key row read once per KV group for all of its query heads.

``extension()`` loads the library built by ``retopk_core.cpu.build`` once per process; when it is
missing, stale (built from another source or torch) or fails to load, it logs one warning and returns
None, and ReTopK runs its torch code.

The library runs at one SIMD level (ISA_NAMES: 0 plain C++, 1 AVX2, 2 AVX-512, 3 AVX-512 with VNNI, which only
the int8 block products use), which ``extension()`` sets once at load: the CPU's best (its ``best_isa()``) unless
the environment variable ``RETOPK_CPU_ISA`` (one of ISA_NAMES, any case, blanks around it ignored) asks for a
lower one, a way to time an AVX2 machine's path on an AVX-512 one. The library's ``isa_level()`` then holds it:
its attention's key scoring (retopk_cpu.cpp's dot_heads) takes its AVX-512 loops only at level 2 or above, and
decoder_ops passes it to the block products. A value outside ISA_NAMES raises ValueError naming the variable
from every ``extension()`` call (so ``available()`` too), whether or not the library is built: a misspelt
request fails the server at startup rather than timing the wrong loops.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass, field

import torch

from retopk_core.cpu import build
from retopk_core.kv import PagedKV
from retopk_core.methods.retopk_policy import calibration_constants, guard_constants
from retopk_core.methods.step_output import Path, StepOutput

log = logging.getLogger(__name__)

# Path codes the kernel writes, in its argument order (reuse, fallback, refresh, promoted).
PATH_CODES = [int(Path.REUSE), int(Path.FALLBACK), int(Path.REFRESH), int(Path.PROMOTED)]
# The library's SIMD levels by name, in its codes (library_ops.h's Isa).
ISA_NAMES = ("scalar", "avx2", "avx512", "avx512_vnni")


def requested_isa() -> int | None:
    """The level RETOPK_CPU_ISA names (stripped, lowercased, one of ISA_NAMES), or None where it is unset or
    blank; ValueError naming the variable for any other value."""
    raw = os.environ.get("RETOPK_CPU_ISA", "")
    asked = raw.strip().lower()
    if not asked:
        return None
    if asked not in ISA_NAMES:
        raise ValueError(f"RETOPK_CPU_ISA must be one of {', '.join(ISA_NAMES)}, got {raw!r}")
    return ISA_NAMES.index(asked)


@functools.cache
def extension():
    """The compiled module at its SIMD level (min(its best_isa(), ``requested_isa()``)), or None (one warning in
    the log) when it cannot be used; ValueError where RETOPK_CPU_ISA is not a level's name."""
    asked = requested_isa()  # first: a bad value is refused on every machine, built or not
    fallback = "backend 'cpu' runs the torch code"
    if not build.LIBRARY.exists():
        log.warning("fused CPU kernel not built (%s missing; run `make install` or `python -m retopk_core.cpu.build`):"
                    " %s", build.LIBRARY, fallback)
        return None
    if not build.up_to_date():
        log.warning("fused CPU kernel %s is stale (built from another source or torch; rerun `python -m "
                    "retopk_core.cpu.build`): %s", build.LIBRARY, fallback)
        return None
    try:
        spec = importlib.util.spec_from_file_location(build.NAME, build.LIBRARY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:  # an ABI mismatch, a missing shared library: any failure means the torch code
        log.warning("fused CPU kernel %s failed to load (%s): %s", build.LIBRARY, e, fallback)
        return None
    best = int(module.best_isa())
    module.set_isa_level(best if asked is None else min(best, asked))
    return module


def available() -> bool:
    """Whether the fused kernel is built and loads in this process."""
    return extension() is not None


def usable(q: torch.Tensor) -> bool:
    """Whether a step on ``q`` can run in the fused kernel: a CPU tensor, and the kernel loads."""
    return q.device.type == "cpu" and available()


def dense_decode(q: torch.Tensor, kv: PagedKV, scale: float, top_k: int = 0,
                 exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q (B, H, d) -> out (B, H, d_v) in q.dtype: softmax over every position (``exact`` False) or over each
    head's top_k best scores (``exact`` True); with top_k > 0 also selected (B, H, top_k) int64, -1 padded,
    in no particular order (ties to the lower position), else None. Needs ``available()``."""
    out, selected = extension().dense_decode(q, kv.k_pool, kv.v_pool, kv.block_table, kv.lengths, float(scale),
                                             int(top_k), bool(exact))
    return out, (selected if top_k else None)


def topk_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores (N, L) float32, unit column stride -> (N, k) int64: the positions of each row's k largest scores,
    the best first, ties to the lower position, -1 where a row has fewer than k finite scores (the positions
    ``sparse.topk_select(scores, None, k)[0]`` selects, up to the order of ties). Needs ``available()``."""
    return extension().topk_rows(scores, int(k))


def retopk_decode(method, q: torch.Tensor, kv: PagedKV, state, slots: torch.Tensor, scale: float) -> StepOutput:
    """One ReTopK decode step (``method.config``) for q (B, H, d) over ``kv``, updating ``state`` in place.

    Needs ``available()``. Returns what the torch path returns: out (B, H, d_v) in q.dtype, path (B, H) int8,
    max_sim (B, H) float32, n_scored (B, H) int32, selected (B, H, K) int64 -1 padded (in no particular order).
    """
    cfg = method.config
    out, path, max_sim, n_scored, selected = extension().decode(
        q, kv.k_pool, kv.v_pool, kv.block_table, kv.lengths, state.queries, state.support, state.fill, state.ptr,
        state.step, slots, state.tau, state.period, state.phase, cfg.top_k, cfg.recall, cfg.window, cfg.refresh_every,
        cfg.recall_successors, cfg.retrieval, cfg.gqa_policy, float(cfg.group_tau_min), float(scale), PATH_CODES,
        calibration_constants(cfg), guard_constants(cfg))
    return StepOutput(out=out, path=path, max_sim=max_sim, n_scored=n_scored, selected=selected)


# decode_layers' attention kinds (decode_layers.cpp): ReTopK's sparse step, dense_decode, ReTopK's plain floor step
RETOPK_STEP, DENSE_STEP, FLOOR_STEP = 0, 1, 2


@dataclass(frozen=True)
class LayerAttention:
    """A method's attention at every layer of a decode step, as ``decode_layers`` (decode_layers.cpp) runs it:
    kind RETOPK_STEP ReTopK's sparse step on each layer's FIFO state (``state``: 8 tensors a layer; ints = (top_k,
    recall, window, refresh_every, recall_successors)), DENSE_STEP
    ``dense_decode`` (ints = (top_k, exact)), FLOOR_STEP ReTopK's plain dense-floor step: Full attention and each
    row's step counter advanced (``state``: each layer's step tensor). A step passes its rows' state slots
    (layers, B) beside it. ``path``: the path code a dense kind reports for every head."""

    kind: int
    ints: list[int]
    path: int = int(Path.DENSE)
    state: list[torch.Tensor] = field(default_factory=list)
    retrieval: str = ""
    gqa_policy: str = ""
    floats: list[float] = field(default_factory=list)
    calibration: list[float] = field(default_factory=list)
    guard: list[float] = field(default_factory=list)


def attention_kind(method, min_length: int, max_length: int) -> int | None:
    """``method``'s attention kind for ``decode_layers`` on a batch whose rows hold ``min_length`` to
    ``max_length`` positions with this step's token, or None where its own per-layer step must run: a method
    without a fused CPU step (or built on another backend), and ReTopK on a batch that is not all past its dense
    floor or all on plain dense-floor steps (the floor's last C steps push exact supports, and a batch across the
    floor is split; ``ReTopK.decode``)."""
    if getattr(method, "steps", None) is None or method.steps.name != "cpu" or not available():
        return None
    if method.name in ("full", "exact_topk"):
        return DENSE_STEP
    if method.name != "retopk":
        return None
    cfg = method.config
    if cfg.dense_below and max_length + cfg.cache_size < cfg.dense_below:  # retopk_policy.plain_dense, every row
        return FLOOR_STEP
    if cfg.dense_below and min_length < cfg.dense_below:
        return None
    return RETOPK_STEP


def layer_attention(method, states: list, kind: int) -> LayerAttention:
    """``method``'s attention of ``kind`` (``attention_kind``) at every layer, on the layers' state pools
    ``states``."""
    if kind == DENSE_STEP:
        if method.name == "exact_topk":
            return LayerAttention(DENSE_STEP, [method.top_k, 1], int(Path.EXACT))
        return LayerAttention(DENSE_STEP, [0, 0], int(Path.DENSE))
    if kind == FLOOR_STEP:
        return LayerAttention(FLOOR_STEP, [0, 0], int(Path.DENSE), [s.step for s in states])
    cfg = method.config
    state = [t for s in states for t in (s.queries, s.support, s.fill, s.ptr, s.step, s.tau, s.period, s.phase)]
    return LayerAttention(RETOPK_STEP, [cfg.top_k, cfg.recall, cfg.window, cfg.refresh_every,
                                        int(cfg.recall_successors)], int(Path.REUSE), state,
                          cfg.retrieval, cfg.gqa_policy, [float(cfg.group_tau_min)], calibration_constants(cfg),
                          guard_constants(cfg))
