"""A ReTopK slot's FIFO rows at or past ``fill`` are never read (QuerySupportCache._rows), so a new sequence's reset
leaves them as an earlier tenant left them and a grown pool's new slots hold whatever their memory held.

The differential tests decode the same sequences twice, in a never-used pool (rows 0 / -1) and in a pool whose
rows past fill (and whose free slots) hold garbage: NaN, infinities, huge values, and support rows of positions
that exist in the history (a leak would change the candidates). The outputs, paths, similarities, candidate
counts and selections must be equal bit for bit, on the torch code and the fused CPU kernel, through reuse while
the FIFO is not full, fallbacks, refreshes and the calibration / guard rules' candidate unions (and on the Triton
kernels, run by the interpreter here).
"""

from __future__ import annotations

import pytest
import torch

from retopk_core.cpu import launch
from retopk_core.kv import PagedKV
from retopk_core.methods import Path, make_method
from tests.core._scenario import make_trace, paged

H, H_KV, D, C = 6, 2, 16, 8
CONFIGS = {
    "similarity": dict(top_k=8, cache_size=C, window=4, recall=4, tau=0.85, refresh_every=5),
    "recent-promote": dict(top_k=8, cache_size=C, window=4, recall=4, tau=0.85, refresh_every=5, retrieval="recent",
                           gqa_policy="promote"),
    "guarded-successors": dict(top_k=8, cache_size=C, window=4, recall=4, tau=0.8, refresh_every=4,
                               gqa_policy="group", tau_calibration=0.8, refresh_guard=0.8, tau_guard=0.9,
                               recall_successors=True),
}
KERNEL = pytest.mark.skipif(not launch.available(), reason="fused CPU kernel not built")
BACKENDS = ["torch", pytest.param("cpu", marks=KERNEL)]
# (config, prefilled, backend): every config both ways on torch and cpu; the Triton kernels (on the CPU under
# TRITON_INTERPRET, tests/conftest.py: slow) on the calibration / guard rules' config and on an empty FIFO
GARBAGE_CASES = [pytest.param(name, prefill, backend, marks=[KERNEL] if backend == "cpu" else [])
                 for name in CONFIGS for prefill in (True, False) for backend in ("torch", "cpu")] + [
    ("guarded-successors", True, "triton"), ("recent-promote", False, "triton")]


def garbage_rows(shape: tuple[int, ...], dtype: torch.dtype, high: int, seed: int) -> torch.Tensor:
    """Values a reader must never use: float rows mixing NaN, +-inf, +-3e38 and ordinary values; int64 rows
    mixing positions in [0, high) (real keys of the history), -1, huge and negative values."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.long:
        pick = torch.randint(0, 4, shape, generator=g)
        pos = torch.randint(0, high, shape, generator=g)
        return torch.where(pick == 0, 2 ** 40, torch.where(pick == 1, -7, pos))
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1.0])
    x = torch.randn(shape, generator=g)
    return torch.where(torch.rand(shape, generator=g) < 0.5, specials[torch.randint(0, 6, shape, generator=g)], x)


def spoil(state, slots: list[int], high: int) -> None:
    """Every FIFO row at or past its slot's fill, and every free slot's rows, to ``garbage_rows``."""
    used = {int(s) for s in slots}
    for s in range(state.capacity):
        f = int(state.fill[s]) if s in used else 0
        for name in ("queries", "support"):
            t = getattr(state, name)[s, :, f:]
            t.copy_(garbage_rows(tuple(t.shape), t.dtype, high, seed=7 * s + len(name)))


def decode_twice(cfg: dict, backend: str, prefill: bool, steps: int = 14):
    """The same trace in a never-used pool and in a spoiled one (grown from one slot, garbage past fill) ->
    per step (fresh StepOutput, spoiled StepOutput, fill before the step, garbage still past fill)."""
    trace = make_trace(B=3, H=H, H_kv=H_KV, d=D, prompt_lens=(40, 23, 9), steps=steps, T=3, noise=0.4)
    B = len(trace.prompt_lens)
    method = make_method("retopk", backend=backend, **cfg)
    fresh = method.init_state(H, H_KV, D, capacity=B)
    spoiled = method.init_state(H, H_KV, D, capacity=1)  # grows (uninitialised memory) while allocating B slots
    slots = {id(fresh): torch.tensor([fresh.alloc() for _ in range(B)]),
             id(spoiled): torch.tensor([spoiled.alloc() for _ in range(B)])}
    high = max(trace.prompt_lens) + steps
    spoil(spoiled, slots[id(spoiled)].tolist(), high)
    for state in (fresh, spoiled) if prefill else ():
        for b, P in enumerate(trace.prompt_lens):
            kv_b = PagedKV.contiguous(trace.keys[b:b + 1], trace.values[b:b + 1], torch.tensor([P]))
            method.prefill(state, int(slots[id(state)][b]), trace.prompt_queries[b], torch.arange(P - 3, P), kv_b)
    for t in range(steps):
        kv = paged(trace.keys, trace.values, trace.lengths_at(t), block=8, seed=t)
        fill = spoiled.fill[slots[id(spoiled)]].clone()  # (B,)
        left = any(bool(torch.isnan(spoiled.queries[s, :, int(spoiled.fill[s]):]).any())
                   for s in slots[id(spoiled)].tolist())
        a = method.decode(trace.queries[t], kv, fresh, slots[id(fresh)])
        b = method.decode(trace.queries[t], kv, spoiled, slots[id(spoiled)])
        yield a, b, fill, left
    for s, z in zip(slots[id(fresh)].tolist(), slots[id(spoiled)].tolist(), strict=True):
        for name, x in fresh.read_slot(s).items():
            assert torch.equal(x, spoiled.read_slot(z)[name]), name


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # Triton's interpreter sums a
# garbage row (NaN) before tl.where drops it, in numpy
@pytest.mark.parametrize(("name", "prefill", "backend"), GARBAGE_CASES)
def test_garbage_past_fill_changes_nothing(name, prefill, backend):
    """Bit-identical steps and states from a never-used pool and a spoiled one; the garbage was really there
    while heads reused a FIFO that was not full, and the trace took reuse, fallback and refresh paths."""
    cfg = CONFIGS[name]
    assert make_method("retopk", backend=backend, **cfg).steps.name == backend
    paths, partial_reuse, spoiled_steps = set(), False, 0
    for a, b, fill, left in decode_twice(cfg, backend, prefill, steps=8 if backend == "triton" else 14):
        for field in ("out", "path", "max_sim", "n_scored", "selected"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field
        paths |= set(b.path.flatten().tolist())
        partial_reuse |= bool(((b.path == Path.REUSE) & (fill < C).view(-1, 1)).any())
        spoiled_steps += left
    assert partial_reuse and spoiled_steps >= 3
    assert {int(Path.REUSE), int(Path.REFRESH)} <= paths and paths & {int(Path.FALLBACK), int(Path.PROMOTED)}


@pytest.mark.parametrize("name", ["retopk", "quest", "tokenselect", "loki"])
def test_a_grown_pools_new_slots_are_handed_out_fresh(name, monkeypatch):
    """Growth takes memory as it comes (``new_empty``, here made to hold 7s and NaNs) and copies only the slots in
    use: every method's new slot, once allocated, exports (``read_slot``) what a new pool's slot 0 exports, and the
    slots in use keep their contents, a free slot between them or not."""
    def dirty(t, size, **kw):
        return t.new_full(size, float("nan") if t.is_floating_point() else 7, **kw)

    monkeypatch.setattr(torch.Tensor, "new_empty", dirty)
    method = make_method(name)
    new, state = method.init_state(4, 2, 16), method.init_state(4, 2, 16)
    first, gap = state.alloc(), state.alloc()  # slot 1 grows the pool to 2
    for f in state.fields:  # 3 everywhere: a full FIFO (fill 3 of retopk's C), 3 tokens seen (quest, loki)
        getattr(state, f)[first] = 3
    kept = state.read_slot(first)
    state.free(gap)
    slots = [state.alloc() for _ in range(4)]  # the freed slot, then growth to 4 and 8
    assert state.capacity == 8 and gap in slots
    for s in slots:
        for f, t in state.read_slot(s).items():
            assert torch.equal(t, new.read_slot(0)[f]), (s, f)
    for f, t in state.read_slot(first).items():
        assert torch.equal(t, kept[f]), f
    assert name != "retopk" or (kept["queries"][:, :3] == 3).all()  # the FIFO rows below fill are the slot's


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forked_slot_decodes_as_its_source(backend):
    """``copy_slot`` copies the FIFO rows below fill only: a slot forked from a FIFO that is not full, into a slot
    full of garbage, decodes the next steps bit for bit as its source and exports the same state."""
    cfg = CONFIGS["guarded-successors"]
    trace = make_trace(B=1, H=H, H_kv=H_KV, d=D, prompt_lens=(40,), steps=8, T=3, noise=0.4)
    method = make_method("retopk", backend=backend, **cfg)
    state = method.init_state(H, H_KV, D, capacity=2)
    src, dst = state.alloc(), state.alloc()
    spoil(state, [dst], 48)
    kv_p = PagedKV.contiguous(trace.keys, trace.values, torch.tensor([40]))
    method.prefill(state, src, trace.prompt_queries[0], torch.arange(37, 40), kv_p)
    kv = PagedKV.contiguous(trace.keys, trace.values, trace.lengths_at(0))
    method.decode(trace.queries[0], kv, state, torch.tensor([src]))
    state.copy_slot(src, dst)
    assert int(state.fill[dst]) == 4 < C and torch.isnan(state.queries[dst, :, 4:]).any()  # the garbage stays
    for t in range(1, 8):
        kv = PagedKV.contiguous(trace.keys, trace.values, trace.lengths_at(t))
        a, b = (method.decode(trace.queries[t], kv, state, torch.tensor([s])) for s in (src, dst))
        for field in ("out", "path", "max_sim", "n_scored", "selected"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (t, field)
    for f, x in state.read_slot(src).items():
        assert torch.equal(x, state.read_slot(dst)[f]), f


@pytest.mark.parametrize("name", ["retopk", "quest", "tokenselect", "loki"])
def test_a_shrunk_pool_keeps_what_its_slots_in_use_export(name, monkeypatch):
    """``shrink`` copies only the slots in use (of ReTopK's FIFOs the rows below fill) into memory as it comes
    (``new_empty``, here made to hold NaNs and 7s): those slots export what they did, and a slot allocated after
    exports a new pool's values."""
    def dirty(t, size, **kw):
        return t.new_full(size, float("nan") if t.is_floating_point() else 7, **kw)

    method = make_method(name)
    new, state = method.init_state(4, 2, 16), method.init_state(4, 2, 16, capacity=8)
    slots = [state.alloc() for _ in range(5)]
    for i, s in enumerate(slots):
        for f in state.fields:
            getattr(state, f)[s] = i + 1  # retopk: fill i + 1, rows below it in use
    for s in (slots[1], slots[4]):
        state.free(s)
    before = {s: state.read_slot(s) for s in (slots[0], slots[2], slots[3])}
    monkeypatch.setattr(torch.Tensor, "new_empty", dirty)
    state.shrink(4)
    assert state.capacity == 4 and state.free_slots == 1
    for s, want in before.items():
        for f, t in state.read_slot(s).items():
            assert torch.equal(t, want[f]), (s, f)
    for f, t in state.read_slot(state.alloc()).items():
        assert torch.equal(t, new.read_slot(0)[f]), f
