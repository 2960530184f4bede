"""A session's state moves between runners: exported after three greedy turns and imported into another
runner (another KV block size), its fourth turn equals the same conversation's never moved, for full, Exact Top-K,
ReTopK and the stateful baselines (Quest, Loki, TokenSelect), and the imported state (FIFOs, page bounds,
projections, selections) equals the exported one. Imported values a kernel indexes with are bounded."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import greedy, prompt_ids, runner_for, three_turns, tiny_model

from retopk_server.runtime import MethodSpec
from retopk_server.runtime.session_state import SessionState, StateMismatch

METHODS = {
    "full": MethodSpec("full"),
    "exact_topk": MethodSpec.of("exact_topk", top_k=8),
    # tau 0.5 and T_r 5: every path (reuse, fallback, refresh) is taken within the turns
    "retopk": MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, tau=0.5, refresh_every=5),
    # budgets well under the ~60 tokens of the turns, so that what each selects depends on its state
    "quest": MethodSpec.of("quest", top_k=12, page_size=4),
    "loki": MethodSpec.of("loki", top_k=8, rank=4),
    "tokenselect": MethodSpec.of("tokenselect", top_k=12, initial=2, local=2, threshold=0.5),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_an_imported_session_continues_as_the_never_moved_one(name):
    model = tiny_model("llama")
    spec = METHODS[name]
    a = runner_for(model, spec, kv_block_size=4, kv_dtype="bfloat16")
    s = a.open_session()
    pending = three_turns(a, s)
    exported = a.export_session(s)

    b = runner_for(model, spec, kv_block_size=8, kv_dtype="bfloat16")
    moved = b.import_session(exported)
    assert moved.token_ids == s.token_ids and moved.method == spec
    again = b.export_session(moved)  # what B holds equals what A held: keys, values, every FIFO field
    for kv in ("k", "v"):  # B's blocks hold 8 positions, A's 4: compared position for position
        assert torch.equal(again.positions(getattr(again, kv)), exported.positions(getattr(exported, kv))), kv
    assert (again.state is None) == (exported.state is None)
    for field, t in (exported.state or {}).items():
        assert torch.equal(again.state[field], t), field
    if name == "retopk":
        assert int(exported.state["fill"].min()) > 0 and int(exported.state["step"].min()) > 0  # a live FIFO
    if name in ("quest", "loki"):  # the grown dimension travels as far as the session uses it, no further
        grown = exported.state["kmin" if name == "quest" else "proj"].shape[2]
        assert grown == (-(-exported.length // 4) if name == "quest" else exported.length)
    if name == "tokenselect":  # carried, though a turn's prefill clears it: only the state's equality shows it
        assert bool(exported.state["has_prev"].all()) and int(exported.state["sel"].max()) >= 0  # a live selection

    fourth = [pending] + prompt_ids(11, seed=9)
    assert greedy(b, moved, fourth, 8) == greedy(a, s, fourth, 8)


def state_of(spec=METHODS["retopk"]) -> tuple:
    model = tiny_model("llama")
    a = runner_for(model, spec, kv_block_size=4, kv_dtype="bfloat16")
    s = a.open_session()
    three_turns(a, s)
    return model, a.export_session(s)


def test_imported_values_out_of_bounds_or_another_setup_are_refused_before_anything_is_allocated():
    model, good = state_of()
    b = runner_for(model, METHODS["retopk"], kv_block_size=8, kv_dtype="bfloat16")

    def variant(**changes) -> SessionState:
        state = {k: t.clone() for k, t in good.state.items()}
        state.update(changes.pop("state", {}))
        return SessionState(**{"method": good.method, "token_ids": good.token_ids, "k": good.k, "v": good.v,
                               "state": state, **changes})

    support = good.state["support"].clone()
    support[0, 0, 0, 0] = good.length  # a position the session does not hold: a kernel would read past it
    one_nan, one_inf = good.state["queries"].clone(), good.state["tau"].clone()
    one_nan[1, 2, 3, 4], one_inf[-1, -1] = float("nan"), float("-inf")  # one value among good ones
    bad = {
        "support past the tokens": (variant(state={"support": support}), ValueError, "support must"),
        "one NaN query": (variant(state={"queries": one_nan}), ValueError, "queries must be finite"),
        "one infinite threshold": (variant(state={"tau": one_inf}), ValueError, "tau must be finite"),
        "fill past C": (variant(state={"fill": good.state["fill"] + 100}), ValueError, "fill"),
        "NaN query": (variant(state={"queries": good.state["queries"] * float("nan")}), ValueError, "finite"),
        "refresh period 0": (variant(state={"period": good.state["period"] * 0}), ValueError, "period"),  # a divisor
        "token id past the vocabulary": (variant(token_ids=good.token_ids + 1000), ValueError, "token_ids"),
        "another KV dtype": (variant(k=good.k.float(), v=good.v.float()), StateMismatch, "kv_dtype"),
        "another model's layers": (variant(k=good.k[:1], v=good.v[:1]), StateMismatch, "KV cache"),
        "blocks not covering the tokens": (variant(k=good.k[:, :1], v=good.v[:, :1]), ValueError, "shape"),
        "another method's state": (variant(method=MethodSpec("quest")), ValueError, "field 'kmin' is missing"),
    }
    for name, (state, error, words) in bad.items():
        with pytest.raises(error, match=words):
            b.import_session(state)
        assert not b.sessions and b.memory().kv_used == 0, name  # nothing half-made
    assert b.import_session(good).length == good.length


@pytest.mark.parametrize("name, field, change, words", [
    ("quest", "n_tokens", lambda t, L: t + L, "n_tokens must"),  # more tokens than the session holds
    ("quest", "kmin", lambda t, L: t.repeat(1, 1, 64, 1), "pages"),  # a pool grown past what the tokens need
    ("loki", "proj", lambda t, L: t[:, :, :1], "tokens"),
    ("loki", "basis", lambda t, L: t * float("inf"), "finite"),
    ("tokenselect", "sel", lambda t, L: t + L, "sel must"),  # positions past the session's tokens
    ("tokenselect", "mid_end", lambda t, L: t - 2 * L, "mid_end must"),
])
def test_a_baselines_state_out_of_bounds_is_refused(name, field, change, words):
    model, good = state_of(METHODS[name])
    b = runner_for(model, METHODS[name], kv_block_size=8, kv_dtype="bfloat16")
    state = {k: t.clone() for k, t in good.state.items()}
    state[field] = change(state[field], good.length)
    bad = SessionState(good.method, good.token_ids, good.k, good.v, state)
    with pytest.raises(ValueError, match=words):
        b.import_session(bad)
    assert not b.sessions and b.memory().kv_used == 0
    assert b.import_session(good).length == good.length


def test_a_method_whose_state_has_no_bounds_cannot_be_imported():
    from retopk_core.methods.base import AttentionMethod

    with pytest.raises(NotImplementedError, match="cannot be imported"):
        AttentionMethod().check_state({"anything": torch.zeros(1)}, 1)
    AttentionMethod().check_state({}, 1)  # no state (full, exact_topk): nothing to bound


@pytest.mark.parametrize("name", ["retopk", "quest", "loki", "tokenselect"])
def test_an_import_into_a_slot_another_session_left_holds_exactly_the_imported_state(name):
    """The slots a closed session left, its FIFOs, pages or selection still in them, take an imported state and
    hold it and nothing else: every field is written. (Loki's ``proj``, grown in a decode step, is an inference
    tensor in a pool whose other fields are not: the import updates each in its own mode.)"""
    model, good = state_of(METHODS[name])
    b = runner_for(model, METHODS[name], kv_block_size=8, kv_dtype="bfloat16")
    other = b.open_session()
    for turn in range(3):  # another conversation than good's (three_turns' prompts with other seeds)
        greedy(b, other, prompt_ids(17 + turn, seed=40 + turn), 6)
    left = b.export_session(other).state
    slots = list(other.slots)
    b.close_session(other)
    moved = b.import_session(good)
    assert moved.slots == slots  # the very slots the closed session left
    again = b.export_session(moved).state
    assert any(not torch.equal(left[f], good.state[f]) for f in good.state if left[f].shape == good.state[f].shape)
    for field, t in good.state.items():
        assert torch.equal(again[field], t), field


@pytest.mark.parametrize("name", ["retopk", "quest", "loki", "tokenselect"])
def test_int64_fields_that_come_as_int32_import_exactly_and_stay_bounded(name):
    """A saved session's file stores an int64 field whose values fit as int32 (engine/session_file.py, format 3):
    the import widens it on its copy into the pool, so the session holds the same values, as int64, and
    continues as the never-moved one; a narrowed value out of bounds is refused as an int64 one is, and an
    integer type narrower still, or an integer where a float belongs, is refused."""
    model, good = state_of(METHODS[name])
    narrowed = {f: t.to(torch.int32) if t.dtype == torch.long else t for f, t in good.state.items()}
    assert any(t.dtype == torch.int32 for t in narrowed.values())
    b = runner_for(model, METHODS[name], kv_block_size=8, kv_dtype="bfloat16")
    moved = b.import_session(SessionState(good.method, good.token_ids, good.k, good.v, narrowed))
    again = b.export_session(moved).state
    for field, t in good.state.items():
        assert again[field].dtype == t.dtype and torch.equal(again[field], t), field
    a = runner_for(model, METHODS[name], kv_block_size=8, kv_dtype="bfloat16")
    never_moved = a.import_session(good)
    turn = prompt_ids(9, seed=5)
    assert greedy(b, moved, turn, 6) == greedy(a, never_moved, turn, 6)

    field = {"retopk": "support", "quest": "n_tokens", "loki": "n_tokens", "tokenselect": "sel"}[name]
    past = dict(narrowed, **{field: narrowed[field] + good.length})  # positions or counts past the session's
    narrower = dict(narrowed, **{field: good.state[field].to(torch.int16)})
    floats = next(f for f, t in good.state.items() if t.is_floating_point())
    as_int = dict(narrowed, **{floats: good.state[floats].to(torch.int32)})
    for state in (past, narrower, as_int):
        with pytest.raises(ValueError, match="must|state field"):
            b.import_session(SessionState(good.method, good.token_ids, good.k, good.v, state))
        assert len(b.sessions) == 1


@pytest.mark.parametrize("ids", [[0, 1, 2, 3, 4], [9, 3, 4, 5, 1], [7, 6, 5, 4, 3]])
def test_a_restore_block_for_block_writes_each_block_where_the_session_holds_it(ids):
    """The same block size on both sides: block j of the state lands in the session's block ``ids[j]``, its
    blocks one run of consecutive ids, several, or each its own; every other block of the pool stays as it was.
    The reference reads the pool by advanced indexing, block by block."""
    from retopk_server.runtime.kv_pool import KVPool
    from retopk_server.runtime.session import Session
    from retopk_server.runtime.session_state import capture, restore

    layers, heads, P, d, L = 2, 2, 4, 3, 18  # 5 blocks, the last holding 2 positions
    pool = KVPool(layers, heads, d, P, torch.float32, "cpu", initial_blocks=12)
    before = [(k.clone(), v.clone()) for k, v in zip(pool.k, pool.v, strict=True)]
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(layers, len(ids), heads, P, d, generator=gen) for _ in range(2))
    state = SessionState(MethodSpec("full"), torch.arange(L), k, v, None)
    session = Session("s", MethodSpec("full"), None, 0, 0)
    session.blocks = list(ids)
    restore(pool, None, session, state)
    held = torch.tensor(ids)
    for layer in range(layers):
        assert torch.equal(pool.k[layer][held], k[layer]) and torch.equal(pool.v[layer][held], v[layer])
        others = torch.tensor([b for b in range(pool.k[layer].shape[0]) if b not in ids])
        assert torch.equal(pool.k[layer][others], before[layer][0][others])
        assert torch.equal(pool.v[layer][others], before[layer][1][others])
    assert session.token_ids == list(range(L))
    again = capture(pool, None, session)  # the rows past L come back zero, as a captured state holds them
    assert torch.equal(again.positions(again.k), state.positions(k)) and torch.equal(again.positions(again.v),
                                                                                    state.positions(v))


@pytest.mark.parametrize("checked", [False, True])
def test_a_state_of_another_shape_than_the_pools_is_refused_whether_or_not_the_import_was_checked(checked):
    """``import_session(checked=True)`` skips ``check_import`` (the bounds, run off the engine thread before), not
    the shapes and dtypes against this runner's pools (``SlotPool.check_slot``, which the bounds do not cover: a
    FIFO of another depth is in bounds by its own shape), which every layer passes before any is written; once
    checked there, a layer is not checked again as it is written. Unchecked, the bounds refuse what they cover."""
    model, good = state_of()
    b = runner_for(model, METHODS["retopk"], kv_block_size=8, kv_dtype="bfloat16")
    deeper = {f: torch.cat([t, t[:, :, -1:]], dim=2) if f in ("queries", "support") else t.clone()
              for f, t in good.state.items()}  # each FIFO one entry deeper than cache_size: bounded, but no fit
    bad = SessionState(good.method, good.token_ids, good.k, good.v, deeper)
    with pytest.raises(ValueError, match="state field 'queries'"):
        b.import_session(bad, checked=checked)
    assert not b.sessions and b.memory().kv_used == 0  # nothing half-made
    support = good.state["support"].clone()
    support[-1, 0, 0, 0] = good.length  # in shape, out of bounds: the bounds' to refuse, on the unchecked path
    if not checked:
        with pytest.raises(ValueError, match="support must"):
            b.import_session(SessionState(good.method, good.token_ids, good.k, good.v,
                                          dict(good.state, support=support)))
        assert not b.sessions
    pool = b.method_group(good.method).states[0]
    layer0 = {f: t[0] for f, t in deeper.items()}
    with pytest.raises(ValueError, match="state field 'queries'"):  # a write of one slot alone checks it
        pool.write_slot(0, layer0)
    assert b.import_session(good, checked=checked).length == good.length
