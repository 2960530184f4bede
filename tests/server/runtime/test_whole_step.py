"""A decode step's layers in one call (runtime/whole_step.py, decoder_ops.LayerPlan) against the same step
layer by layer: logits, statistics, KV cache and method state equal bit for bit, for every method with a
fused CPU step, batched; and the steps that must stay layer by layer do."""

from __future__ import annotations

import pytest
import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_core.cpu import decoder_ops
from retopk_core.methods import Path
from retopk_server.engine.requests import EngineConfig
from retopk_server.runtime import MethodSpec, whole_step
from retopk_server.runtime.decoder.linear import wide_rows

pytestmark = pytest.mark.skipif(not decoder_ops.available(), reason="the fused CPU library is not built")

RETOPK = MethodSpec.of("retopk", top_k=8, cache_size=8, window=8, recall=2, refresh_every=5, dense_below=32, tau=0.3,
                       tau_calibration=0.8)
METHODS = {"full": MethodSpec.of("full"), "exact_topk": MethodSpec.of("exact_topk", top_k=8), "retopk": RETOPK,
           "retopk-floor": MethodSpec.of("retopk", top_k=8, cache_size=8, dense_below=200),  # plain floor steps
           "retopk-guard": MethodSpec.of("retopk", top_k=8, cache_size=8, window=8, recall=2, refresh_every=4,
                                         dense_below=32, tau=0.3, tau_calibration=0.8, tau_guard=0.9),
           "retopk-successors": MethodSpec.of("retopk", top_k=8, cache_size=8, window=8, recall=2, refresh_every=4,
                                              dense_below=32, tau=0.3, tau_calibration=0.8, tau_guard=0.9,
                                              recall_successors=True),
           "retopk-onset": MethodSpec.of("retopk", top_k=8, cache_size=8, window=8, recall=2, refresh_every=4,
                                         dense_below=32, tau=0.3, tau_calibration=0.8, refresh_first=3)}


def _state(runner, session) -> list[torch.Tensor]:
    """The session's KV (its blocks, every layer) and method state (every field, every layer, as ``read_state``
    exports it: a slot's FIFO rows past its fill hold whatever the memory held and are never read)."""
    group = runner.method_group(session.method)
    blocks = torch.tensor(session.blocks)
    kv = [t[blocks] for pools in (runner.pool.k, runner.pool.v) for t in pools]
    return kv + list(group.read_state(session.slots).values())


def _spy(monkeypatch, module, name: str) -> list:
    """Replace module.name by a wrapper that records each call's result -> the list of results."""
    real, seen = getattr(module, name), []

    def spy(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize(("name", "activations"), [(name, "float32") for name in METHODS] + [("retopk", "int8"),
                                                                                             ("retopk", "int16")] + [
    pytest.param("retopk", "bf16x2", marks=pytest.mark.skipif(not decoder_ops.amx_available(),
                                                              reason="bf16x2 needs AMX-BF16"))])
def test_one_call_equals_layer_by_layer(name, activations, monkeypatch):
    """Two pairs of sessions on the same prompts, decoded as batches of two: one pair in one call per step, the
    other layer by layer. Every step's logits and statistics, and in the end every KV row and state tensor,
    are equal; the one-call path really ran (a spy counts its calls). With int8, int16 and bf16x2 activations too; with
    tau_guard, some head's tau rose above tau0 (the guard acted in both); with recall_successors, some reuse head
    scored more candidates than R*K + W (the successors were among them in both)."""
    runner = runner_for(tiny_model("llama", layers=3), METHODS[name], weights="int4", kv_dtype="bfloat16",
                        activations=activations)
    assert runner.decoder.fused
    prompts = [prompt_ids(40, 1), prompt_ids(45, 2)]
    pairs = []
    for _ in range(2):
        sessions = [runner.open_session(METHODS[name]) for _ in prompts]
        tokens = [int(runner.prefill(s, p).argmax()) for s, p in zip(sessions, prompts, strict=True)]
        pairs.append((sessions, tokens))
    calls = _spy(monkeypatch, decoder_ops.LayerPlan, "__call__")
    paths, grown = set(), False
    for _ in range(12):
        out = []
        for one_call, (sessions, tokens) in zip((True, False), pairs, strict=True):
            runner.layers_in_one_call = one_call
            logits, stats = runner.decode(sessions, tokens, with_stats=True)
            tokens[:] = logits.argmax(-1).tolist()
            out.append((logits, stats))
        (a, sa), (b, sb) = out
        assert torch.equal(a, b)
        for x, y in zip(sa, sb, strict=True):
            assert torch.equal(x.path, y.path) and torch.equal(x.n_scored, y.n_scored)
            assert torch.equal(x.max_sim.nan_to_num(-9), y.max_sim.nan_to_num(-9))
            assert x.attention_s > 0
            paths |= set(x.path.flatten().tolist())
            grown |= bool((x.n_scored[x.path == Path.REUSE] > 2 * 8 + 8).any())  # R*K + W
    assert len(calls) == 12
    for s, t in zip(*(pair[0] for pair in pairs), strict=True):
        for x, y in zip(_state(runner, s), _state(runner, t), strict=True):
            assert torch.equal(x, y)
    expected = {"full": {Path.DENSE}, "exact_topk": {Path.EXACT}, "retopk-floor": {Path.DENSE},
                "retopk": {Path.REUSE, Path.FALLBACK, Path.REFRESH}, "retopk-guard": {Path.REUSE, Path.REFRESH},
                "retopk-successors": {Path.REUSE, Path.REFRESH}, "retopk-onset": {Path.REUSE, Path.REFRESH}}[name]
    assert {int(p) for p in expected} <= paths
    assert grown == (name == "retopk-successors")
    if name in ("retopk-guard", "retopk-successors"):
        group = runner.method_group(METHODS[name])
        assert any(bool((pool.tau[slot] > 0.3 + 1e-6).any()) for sessions, _ in pairs for s in sessions
                   for pool, slot in zip(group.states, s.slots, strict=True))


def test_rows_past_fill_are_not_read_in_one_call(monkeypatch):
    """The one-call step reads ReTopK's FIFO rows below fill only: two sessions on the same prompt, shorter than the
    FIFO (not full for the first steps), one in a never-used slot and one whose rows past its fill hold garbage
    (NaN, infinities, huge values, positions of real keys), each decoded alone in one call a step: the logits and
    statistics are equal bit for bit, through reuse, fallback and refresh, and so are the exported states."""
    from tests.core.test_slot_rows import garbage_rows

    C = 64
    spec = MethodSpec.of("retopk", top_k=8, cache_size=C, window=8, recall=4, refresh_every=5, tau=0.3,
                         tau_calibration=0.8)
    runner = runner_for(tiny_model("llama", layers=2), spec, weights="int4", kv_dtype="bfloat16")
    prompt = prompt_ids(40, 1)
    sessions = [runner.open_session(spec) for _ in range(2)]
    tokens = [int(runner.prefill(s, prompt).argmax()) for s in sessions]
    group = runner.method_group(spec)
    for layer, (pool, slot) in enumerate(zip(group.states, sessions[1].slots, strict=True)):
        f = int(pool.fill[slot])
        assert f < C
        for name in ("queries", "support"):
            rows = getattr(pool, name)[slot, :, f:]
            rows.copy_(garbage_rows(tuple(rows.shape), rows.dtype, 40, seed=layer))
    calls = _spy(monkeypatch, decoder_ops.LayerPlan, "__call__")
    paths = set()
    for _ in range(12):
        out = []
        for i, s in enumerate(sessions):
            logits, stats = runner.decode([s], [tokens[i]], with_stats=True)
            tokens[i] = int(logits[0].argmax())
            out.append((logits, stats))
        (a, sa), (b, sb) = out
        assert torch.equal(a, b)
        for x, y in zip(sa, sb, strict=True):
            assert torch.equal(x.path, y.path) and torch.equal(x.n_scored, y.n_scored)
            assert torch.equal(x.max_sim, y.max_sim)
            paths |= set(y.path.flatten().tolist())
    assert len(calls) == 24
    assert {int(Path.REUSE), int(Path.FALLBACK), int(Path.REFRESH)} <= paths
    for x, y in zip(_state(runner, sessions[0]), _state(runner, sessions[1]), strict=True):
        assert torch.equal(x, y)
    pool, slot = group.states[0], sessions[1].slots[0]
    assert int(pool.fill[slot]) < C and torch.isnan(pool.queries[slot, :, int(pool.fill[slot]):]).any()  # still there


def test_refresh_first_refreshes_the_first_steps_of_each_turn():
    """refresh_first = 3 through the runner: after the first prompt's prefill and after a later turn's, the first 3
    decode steps refresh every head of every layer, and the 2 after them do not (they reuse at tau = 0.3)."""
    spec = METHODS["retopk-onset"]
    runner = runner_for(tiny_model("llama", layers=2), spec, weights="int4", kv_dtype="bfloat16")
    session = runner.open_session(spec)
    token = int(runner.prefill(session, prompt_ids(40, 1)).argmax())
    for turn in range(2):
        refreshed = []
        for _ in range(5):
            logits, stats = runner.decode([session], [token], with_stats=True)
            token = int(logits[0].argmax())
            refreshed.append(bool((stats[0].path == Path.REFRESH).all()))
        assert refreshed == [True, True, True, False, False], (turn, refreshed)
        token = int(runner.prefill(session, prompt_ids(6, 2 + turn)).argmax())  # the next turn's prompt


def test_layer_by_layer_where_one_call_cannot_run(monkeypatch):
    """ReTopK within C steps below its dense floor (where it pushes exact supports), a method without a fused
    CPU step, and a batch of two methods decode layer by layer (whole_step declines), and still decode."""
    runner = runner_for(tiny_model("llama", layers=2), RETOPK, weights="int4", kv_dtype="bfloat16")
    short = runner.open_session(RETOPK)
    quest = runner.open_session(MethodSpec.of("quest", top_k=8, page_size=8))
    full = runner.open_session(MethodSpec.of("full"))
    for s in (short, quest, full):
        runner.prefill(s, prompt_ids(25, 3))  # L_t = 26: 26 + C >= dense_below = 32 > 26
    seen = _spy(monkeypatch, whole_step, "attention_kind")
    for batch in ([short], [quest], [short, full]):
        logits, _ = runner.decode(batch, [1] * len(batch))
        assert torch.isfinite(logits).all()
    assert seen == [None, None]  # the floor's pushing steps and quest declined; the mixed batch never asked


def test_other_threads_run_during_a_whole_step(monkeypatch):
    """The one-call step releases the GIL: a Python thread spinning beside it runs during the call. Each of 50
    calls counts the spinner's ticks from just before it to its return; with the GIL held the spinner could
    tick only in the few bytecodes between the count and the call, so most counts would be 0. Each call takes
    turns with a control of about its length that is known to release the GIL (hashing bytes): where the
    spinner got into fewer than half of those either (a machine too loaded to wake it in time), the test
    cannot tell, and skips."""
    import hashlib
    import threading
    import time

    runner = runner_for(tiny_model("llama", layers=3), METHODS["full"], weights="int4", kv_dtype="bfloat16")
    session = runner.open_session(METHODS["full"])
    runner.prefill(session, prompt_ids(200, 4))
    lib = decoder_ops.extension()
    ticks, stop, deltas, control = [0], threading.Event(), [], []
    block = bytes(1 << 24)
    start = time.perf_counter()
    hashlib.sha256(block)
    hash_rate = len(block) / (time.perf_counter() - start)  # bytes a second

    class Repeated:  # the prepared layers, each step's run repeated and the spinner's ticks counted
        def __init__(self, *args):
            self.layers = lib.DecodeLayers(*args)

        def run(self, *args):
            for _ in range(50):
                before, start = ticks[0], time.perf_counter()
                out = self.layers.run(*args)
                took = time.perf_counter() - start
                deltas.append(ticks[0] - before)
                before = ticks[0]
                hashlib.sha256(block[:max(4096, int(took * hash_rate))])  # releases the GIL past 2 KiB
                control.append(ticks[0] - before)
            return out

    class Counted:  # the library, with its DecodeLayers repeated
        DecodeLayers = Repeated

        def __getattr__(self, name):
            return getattr(lib, name)

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    monkeypatch.setattr(decoder_ops, "extension", Counted)
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        runner.decode([session], [1])
    finally:
        stop.set()
        thread.join()
    assert len(deltas) == len(control) == 50
    if sum(c > 0 for c in control) <= 25:
        pytest.skip(f"the spinner ran in only {sum(c > 0 for c in control)} of 50 controls: too loaded to tell")
    assert sum(d > 0 for d in deltas) > 25, (deltas, control)


def test_one_call_up_to_the_wide_rule_and_rows_as_alone(monkeypatch):
    """A batch of wide_rows(dtype, activations) - 1 rows (dtype: the layers' wide copies; float32 activations, whose
    rule ends on every CPU) runs in one call and each row's logits equal the same row decoded alone bit for bit; a
    batch of wide_rows(dtype, activations) rows goes layer by layer through the wide copies (decoder/linear.py's
    rule), and still decodes."""
    runner = runner_for(tiny_model("llama", layers=2), METHODS["full"], weights="int4", kv_dtype="bfloat16",
                        activations="float32")
    n = wide_rows(runner.decoder.layers[0].qkv.wide_dtype, runner.decoder.activations)
    prompts = [prompt_ids(6 + i, i) for i in range(n)]

    def opened(count):
        sessions = [runner.open_session(METHODS["full"]) for _ in range(count)]
        return sessions, [int(runner.prefill(s, p).argmax()) for s, p in zip(sessions, prompts[:count], strict=True)]

    calls = _spy(monkeypatch, decoder_ops.LayerPlan, "__call__")
    (batch, tokens), (alone, alone_tokens) = opened(n - 1), opened(n - 1)
    logits, _ = runner.decode(batch, tokens)
    assert len(calls) == 1
    for i, (s, t) in enumerate(zip(alone, alone_tokens, strict=True)):
        assert torch.equal(runner.decode([s], [t])[0][0], logits[i]), i
    wide, wide_tokens = opened(n)
    logits, _ = runner.decode(wide, wide_tokens)
    assert len(calls) == 1 + (n - 1) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ["full", "retopk"])
def test_int16_full_batch_takes_one_call_and_rows_as_alone(name, monkeypatch):
    """With int16 activations a batch of the engine's max_running streams runs its decode step's layers in one call
    (whole_step gives the layers, not None: linear.py's rule keeps int16's products on the blocks there) and each
    session's logits equal its logits decoded alone, bit for bit: int16's block products, attention, the norms
    and the LM head do not depend on the batch. Prompts of 36 to 51 tokens: ReTopK's steps are past dense_below."""
    from retopk_server.runtime import runner as runner_module

    B = EngineConfig().max_running
    runner = runner_for(tiny_model("llama", layers=2), METHODS[name], weights="int4", kv_dtype="bfloat16",
                        activations="int16")
    prompts = [prompt_ids(36 + i, i) for i in range(B)]

    def opened(count):
        sessions = [runner.open_session(METHODS[name]) for _ in range(count)]
        return sessions, [int(runner.prefill(s, p).argmax()) for s, p in zip(sessions, prompts[:count], strict=True)]

    layers = _spy(monkeypatch, runner_module, "whole_step")
    (batch, tokens), (alone, alone_tokens) = opened(B), opened(B)
    for _ in range(3):
        logits, _ = runner.decode(batch, tokens)
        assert layers[-1] is not None
        for i, (s, t) in enumerate(zip(alone, alone_tokens, strict=True)):
            assert torch.equal(runner.decode([s], [t])[0][0], logits[i]), i
        tokens[:] = alone_tokens[:] = logits.argmax(-1).tolist()


@pytest.mark.parametrize("reserved", [True, False], ids=["pool-in-place", "pool-copied"])
def test_the_prepared_layers_follow_the_pools(reserved, monkeypatch):
    """whole_step keeps one prepared plan per method group and kind from step to step, and prepares it again once
    the KV pool or the method state is reallocated: after the KV pool grows (a wider view of its reservation, or
    by copying where there is none) and the state pools double (five more sessions), and after both shrink back,
    every step's logits and the sessions' KV and state still equal a pair decoded layer by layer. The plan is the
    same object between changes and a new one after each; it holds the pools and state weakly, so a replaced
    state tensor is freed."""
    import gc
    import weakref

    from retopk_core.cpu.launch import RETOPK_STEP
    from retopk_server.runtime import kv_pool

    if not reserved:
        monkeypatch.setattr(kv_pool, "reserve", lambda *args: None)
    runner = runner_for(tiny_model("llama", layers=2), RETOPK, weights="int4", kv_dtype="bfloat16")
    assert (runner.pool._reserved is not None) == reserved
    prompts = [prompt_ids(40, 1), prompt_ids(45, 2)]
    pairs = []
    for _ in range(2):
        sessions = [runner.open_session(RETOPK) for _ in prompts]
        pairs.append((sessions, [int(runner.prefill(s, p).argmax()) for s, p in zip(sessions, prompts, strict=True)]))
    group = runner.method_group(RETOPK)

    def steps(n: int) -> object:
        for _ in range(n):
            out = []
            for one_call, (sessions, tokens) in zip((True, False), pairs, strict=True):
                runner.layers_in_one_call = one_call
                logits, _ = runner.decode(sessions, tokens)
                tokens[:] = logits.argmax(-1).tolist()
                out.append(logits)
            assert torch.equal(*out)
        return group.plans[RETOPK_STEP][3]

    first = steps(3)
    assert steps(1) is first  # nothing changed: the same plan
    old_queries = weakref.ref(group.states[0].queries)
    runner.pool.make_free(runner.pool.free_blocks + 3 * runner.pool.capacity)  # the KV pool grows
    extra = [runner.open_session(RETOPK) for _ in range(5)]
    for i, s in enumerate(extra):  # nine slots: every layer's state pool doubles from 4 to 8 and 16
        runner.prefill(s, prompt_ids(50, 3 + i))
    grown = steps(3)
    assert grown is not first
    gc.collect()
    assert old_queries() is None  # the plan did not keep the replaced state alive
    for s in extra:
        runner.close_session(s)
    capacity, slots = runner.pool.capacity, group.states[0].capacity
    runner.trim_pools(pressure=True)
    runner.pool.trim(pressure=True)
    assert runner.pool.capacity < capacity and group.states[0].capacity < slots
    assert steps(3) is not grown
    for s, t in zip(*(pair[0] for pair in pairs), strict=True):
        for x, y in zip(_state(runner, s), _state(runner, t), strict=True):
            assert torch.equal(x, y)
