"""Each method's backend steps are chosen once, when it is built (methods/backend_steps.py), and its decode runs
through them: a method built while the CPU kernel is missing keeps the torch steps, one built with it the
kernel's, whatever happens to the kernel later."""

from __future__ import annotations

import pytest
import torch

from retopk_core.cpu import launch as cpu_launch
from retopk_core.methods import make_method
from retopk_core.methods.backend_steps import CpuSteps, TorchSteps, TritonSteps, steps_for
from tests.core._scenario import make_trace, paged


@pytest.mark.parametrize("backend, kind", [("torch", TorchSteps), ("triton", TritonSteps)])
def test_each_backend_gets_its_steps(backend, kind):
    assert type(steps_for(backend)) is kind


def test_the_cpu_backend_gets_the_kernel_where_it_loads_else_the_torch_steps(monkeypatch):
    if cpu_launch.available():
        assert type(make_method("retopk", backend="cpu").steps) is CpuSteps
    monkeypatch.setattr(cpu_launch, "available", lambda: False)
    for name in ("full", "exact_topk", "retopk"):
        assert type(make_method(name, backend="cpu").steps) is TorchSteps


class Marked(TorchSteps):
    """The torch steps with every output replaced by a constant, to see which step a decode took."""

    def dense(self, q, kv, scale):
        return torch.full_like(q, 3.0)

    def exact_topk(self, q, kv, k, scale, ws):
        return torch.full_like(q, 5.0), torch.full((*q.shape[:2], k), -1, dtype=torch.long)


@pytest.mark.parametrize("name, value", [("full", 3.0), ("exact_topk", 5.0), ("retopk", 3.0)])
def test_a_decode_runs_through_the_steps_it_was_built_with(name, value):
    params = {"top_k": 4} if name == "exact_topk" else {"dense_below": 10_000} if name == "retopk" else {}
    method = make_method(name, backend="torch", **params)
    method.steps = Marked()
    trace = make_trace(B=2, H=4, H_kv=2, prompt_lens=(20, 9), steps=1)
    state = method.init_state(4, 2, 16)
    slots = torch.tensor([state.alloc(), state.alloc()])
    out = method.decode(trace.queries[0], paged(trace.keys, trace.values, trace.lengths_at(0), 8), state, slots).out
    assert torch.equal(out, torch.full_like(out, value))
