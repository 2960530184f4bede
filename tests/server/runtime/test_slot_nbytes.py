"""MethodGroup.slot_nbytes, summed once per change of the layers' pools: it equals the sum over the layers'
``nbytes_per_slot`` (taken here afresh) after the slots grow and shrink and after a growing field (Quest's pages,
Loki's tokens) grows in one layer, for every method with a pool, the fidelity probe's wrapped pools included."""

from __future__ import annotations

import pytest

import retopk_core.methods.probe  # noqa: F401 - registers fidelity_probe
from retopk_core.methods.registry import make_method, method_names
from retopk_server.runtime.attention import MethodGroup

PARAMS = {"full": {}, "streaming_llm": {"top_k": 4, "sinks": 1}, "retopk": {"top_k": 4, "cache_size": 4, "window": 2},
          "quest": {"top_k": 4, "page_size": 2},
          "loki": {"top_k": 4, "rank": 2}, "tokenselect": {"top_k": 4, "initial": 1, "local": 1}}
CASES = [(name, PARAMS.get(name, {"top_k": 4})) for name in method_names() if name != "fidelity_probe"]
CASES += [("fidelity_probe", {"inner": inner, **PARAMS[inner]}) for inner in ("quest", "loki")]


def summed(g: MethodGroup) -> int:
    return sum(state.nbytes_per_slot() for state in g.states)


@pytest.mark.parametrize(("name", "params"), CASES, ids=[c[0] + "-" + c[1].get("inner", "") for c in CASES])
def test_slot_nbytes_follows_the_pools(name, params):
    g = MethodGroup(make_method(name, **params), 3, num_heads=4, num_kv_heads=2, head_dim=8, device="cpu")
    start = g.slot_nbytes()
    assert start == summed(g)
    slots = [g.alloc() for _ in range(5)]  # the slots grow 1 -> 8: a slot's size stays
    assert g.states[0].capacity == 8 and g.slot_nbytes() == summed(g) == start
    for s in slots[1:]:
        g.free(s)
    assert g.shrink(hold=False) == 7 * start and g.states[0].capacity == 1 and g.slot_nbytes() == summed(g) == start
    inner = getattr(g.states[1], "inner", g.states[1])  # the fidelity probe's: the wrapped method's pool
    try:
        inner.ensure_extent(200)  # one layer's pages / tokens grow past their start: every slot grows
    except NotImplementedError:
        return  # no growing field: a slot's size never changes
    grown = g.slot_nbytes()
    assert grown == summed(g) > start
    g.alloc()  # and the slots once more, at the grown size
    assert g.slot_nbytes() == summed(g) == grown
