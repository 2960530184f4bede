"""A runtime decode step with ReTopK's Triton backend (interpreted on this CPU) reads nothing back from the
device between its first and last layer: no ``.item()`` / ``int(t)`` / ``bool(t)`` (aten._local_scalar_dense),
no ``nonzero`` or boolean-mask indexing, no ``.tolist()`` / ``.cpu()`` / ``.numpy()`` in the repository's
code, no ``torch.cuda.synchronize``. (``.to(device)`` is not counted: on a CPU runner the host-to-device
copies of the step's inputs look the same as a read back.) With statistics on, the forward makes exactly one host copy.

On a CPU these calls cost nothing, but each one is a device-to-host round trip on a GPU; counting them
here is what keeps the GPU step free of them. The sampler runs after ``runner.decode`` and is not counted.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from retopk_core.methods.base import Path as CorePath
from retopk_server.runtime import MethodSpec
from retopk_server.runtime import attention as attention_mod

ROOT = Path(__file__).resolve().parents[3]
OURS = (str(ROOT / "retopk_core"), str(ROOT / "server" / "retopk_server"))
# ops that need the host to read device memory (or the device's result size) before they return
SYNC_OPS = {"aten._local_scalar_dense.default", "aten.item.default", "aten.is_nonzero.default", "aten.nonzero.default",
            "aten.nonzero_numpy.default", "aten.masked_select.default", "aten._unique2.default",
            "aten.unique_dim.default", "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor"}


class SyncCounter(TorchDispatchMode):
    """Counts sync-inducing aten ops (and indexing by a boolean mask, which runs a nonzero)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNC_OPS:
            self.ops[name] += 1
        elif name.startswith(("aten.index.", "aten.index_put")) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.ops[name + "[bool mask]"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_calls(monkeypatch):
    """Counter of host reads made by the repository's own code (callers under retopk_core / retopk_server):
    Tensor.tolist / cpu / numpy, and every torch.cuda.synchronize."""
    calls: collections.Counter = collections.Counter()

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(OURS):
                calls[f"{Path(caller).name}:{name}"] += 1
            return original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counted)

    for name in ("tolist", "cpu", "numpy"):
        wrap(name)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.update(["torch.cuda.synchronize"]))
    return calls


def _sessions(runner, spec):
    """Two sessions: one below the dense floor (48) that crosses it during the test, one above it."""
    short, long_ = runner.open_session(spec), runner.open_session(spec)
    toks = [int(runner.prefill(short, prompt_ids(45, seed=1)).argmax()),
            int(runner.prefill(long_, prompt_ids(70, seed=2)).argmax())]
    return [short, long_], toks


SPEC = MethodSpec.of("retopk", top_k=16, cache_size=8, window=4, recall=2, tau=0.5, refresh_every=3,
                     dense_below=48, gqa_policy="group", tau_calibration=0.85)  # the server default calibrates


def _forward_counted(runner, monkeypatch, counter: SyncCounter, host_calls, seen: list):
    """Count inside the model forward only (first layer to last), recording host calls per forward."""
    original = runner.forward

    def forward(*args, **kwargs):
        before = collections.Counter(host_calls)
        with counter:
            out = original(*args, **kwargs)
        seen.append(host_calls - before)
        return out
    monkeypatch.setattr(runner, "forward", forward)


@pytest.mark.slow
@pytest.mark.full  # the Triton interpreter over five whole decode steps: `make test-full`
def test_triton_decode_step_reads_nothing_back_without_stats(host_calls):
    runner = runner_for(tiny_model("llama"), SPEC, backend="triton", kv_block_size=16)
    sessions, toks = _sessions(runner, SPEC)
    paths = set()
    for _ in range(5):
        counter = SyncCounter()
        before = collections.Counter(host_calls)
        with counter:
            logits, stats = runner.decode(sessions, toks)
        assert stats is None
        assert not counter.ops, dict(counter.ops)
        assert not host_calls - before, dict(host_calls - before)
        toks = logits.argmax(-1).tolist()  # the sampler's read, outside the counted step
        _, stats = runner.decode(sessions, toks, with_stats=True)  # (paths of the same sessions, for coverage)
        paths |= {int(p) for st in stats for p in st.path.flatten()}
        toks = [int(t) for t in runner.decode(sessions, toks)[0].argmax(-1)]
    assert {CorePath.DENSE, CorePath.REUSE} <= paths, paths  # the floor and the sparse step both ran


@pytest.mark.slow
def test_triton_decode_step_with_stats_makes_one_host_copy(host_calls, monkeypatch):
    runner = runner_for(tiny_model("llama"), SPEC, backend="triton", kv_block_size=16)
    sessions, toks = _sessions(runner, SPEC)
    counter, seen = SyncCounter(), []
    _forward_counted(runner, monkeypatch, counter, host_calls, seen)
    for _ in range(3):
        logits, stats = runner.decode(sessions, toks, with_stats=True)
        toks = logits.argmax(-1).tolist()
        assert [s.path.shape for s in stats] == [(2, 4)] * 2  # (layers, heads) per session
        assert all(s.attention_s > 0 for s in stats)
    assert not counter.ops, dict(counter.ops)
    assert seen == [collections.Counter({"attention.py:cpu": 1})] * 3, seen  # one packed copy per step


def test_stats_timing_uses_events_not_synchronisation(monkeypatch, host_calls):
    """On a GPU the attention core is timed by CUDA events read after the step's one copy: with event
    timing forced on (fake events on this CPU), no synchronize happens and the events' times are summed."""
    made = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.recorded = False
            made.append(self)

        def record(self, stream=None):
            self.recorded = True

        def elapsed_time(self, end):
            assert self.recorded and end.recorded
            return 2.0  # ms

    monkeypatch.setattr(attention_mod, "_event_timing", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    spec = MethodSpec.of("retopk", top_k=8, cache_size=4, window=4, recall=2)
    runner = runner_for(tiny_model("llama"), spec, backend="torch", kv_block_size=16)
    session = runner.open_session(spec)
    tok = int(runner.prefill(session, prompt_ids(30, seed=3)).argmax())
    _, stats = runner.decode([session], [tok], with_stats=True)
    assert len(made) == 2 * 2  # a start and an end event per layer (2 layers, one method group)
    assert stats[0].attention_s == pytest.approx(2 * 2.0 / 1000)
    assert host_calls["torch.cuda.synchronize"] == 0


def test_to_host_round_trips_bit_for_bit():
    ts = [torch.tensor([[0, 7, -3]], dtype=torch.int8), torch.tensor([float("nan"), -0.0, 1.5e-30]),
          torch.tensor([2 ** 31 - 1, -5], dtype=torch.int32), torch.arange(6, dtype=torch.long).view(2, 3)[:, 1:]]
    out = attention_mod.to_host(ts)
    for a, b in zip(ts, out, strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape and b.device.type == "cpu"
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    assert attention_mod.to_host([]) == []
