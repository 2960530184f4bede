"""ModelRunner.close_sessions: a wave of sessions that end in one decode step closed together frees what closing them
one by one freed (the same bytes in use, method-state pools, open sessions and prefix cache; the KV pool at the size
its rule gives for what is left, which one by one can overshoot), with the KV pool compacted
once rather than at each close that leaves it below a quarter used; the session left open and the cached prompt go
on as on the runner that closed one by one (the same greedy tokens, the same cache hit)."""

from __future__ import annotations

import torch
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.runtime import MethodSpec
from retopk_server.runtime.prefix_cache import namespace

SPEC = MethodSpec.of("retopk", top_k=8, cache_size=4, window=2, recall=2, refresh_every=0, tau=0.0, dense_below=0)
OTHER = MethodSpec.of("retopk", top_k=4, cache_size=4, window=2, recall=2, refresh_every=0, tau=0.0, dense_below=0)
KEY = namespace("alice")


def wave(runner, shared: list[int]):
    """8 sessions (two of a second method) whose prompts start with ``shared`` (cached after the first), then one
    that stays open, decoding 12 steps together -> (the one left open and its next token, the 8). The 8 hold most
    of the used blocks, so closing them one by one takes the pool below a quarter used while some are open."""
    ending = []
    for i in range(8):
        s = runner.open_session(OTHER if i in (2, 5) else None, f"s{i}")
        job = runner.start_prefill(s, shared + prompt_ids(1 + i % 3, seed=10 + i), KEY)
        while job.step(64) is None:
            pass
        ending.append(s)
    live = runner.open_session(session_id="live")
    toks = [1] * 8 + [int(runner.prefill(live, prompt_ids(9, seed=1)).argmax())]
    for _ in range(12):
        logits, _ = runner.decode([*ending, live], toks)
        toks = [int(t) for t in logits.argmax(-1)]
    return live, toks[-1], ending


def figures(runner) -> dict:
    return {"memory": runner.memory(), "kv_capacity": runner.pool.capacity, "kv_free": runner.pool.free_blocks,
            "open": sorted(runner.sessions), "groups": sorted(repr(s) for s in runner._groups),
            "slots": {repr(s): (g.used_slots, g.states[0].capacity) for s, g in runner._groups.items()},
            "cached": len(runner.prefix_cache)}


def test_closing_a_wave_together_frees_what_one_by_one_did_with_one_compaction():
    model = tiny_model("llama")
    shared = prompt_ids(16, seed=5)
    one, together = (runner_for(model, SPEC, kv_block_size=4, prefill_chunk=4, kv_cache_bytes=1 << 26)
                     for _ in range(2))
    compactions = {}
    for name, runner in (("one", one), ("together", together)):
        original = runner.pool.compact

        def counted(original=original, name=name):
            moved = original()
            compactions[name] = compactions.get(name, 0) + bool(moved)
            return moved

        runner.pool.compact = counted
    with torch.inference_mode():
        live_a, tok_a, ending_a = wave(one, shared)
        live_b, tok_b, ending_b = wave(together, shared)
        assert tok_a == tok_b and figures(one) == figures(together)
        for s in ending_a:
            one.close_session(s)
        together.close_sessions(ending_b)
        together.close_sessions(ending_b)  # idempotent, as close_session
        assert all(s.closed and s.blocks == [] and s.slots is None for s in ending_b)
        # what is left in use, counted from the one session left open (close_session goes through close_sessions)
        used = together.memory()
        assert sorted(together.sessions) == ["live"] and together.pool.holders(live_b.blocks[0]) == 1
        assert used.kv_used == len(live_b.blocks) * together.pool.block_nbytes
        assert used.method_state_used == together.method_group(SPEC).slot_nbytes()
        assert OTHER not in together._groups  # its last session closed: its pools are gone
        # The same in use; the KV pool's size differs by the path: one by one it shrank on the way down, at a
        # close that left it a quarter used, and then kept that size (its hysteresis); together it goes at once
        # to what its rule gives for what is left, the size one by one reaches with a compaction and a trim.
        assert together.pool.capacity <= one.pool.capacity
        one._compact()
        one.pool.trim()
        assert figures(one) == figures(together)
        assert compactions.get("one", 0) >= 2 and compactions.get("together", 0) <= 1
        # the session left open and the cached prompt read what they did before the closes, on both runners
        after = [[], []]
        for runner, live, tok, out in ((one, live_a, tok_a, after[0]), (together, live_b, tok_b, after[1])):
            for _ in range(4):
                logits, _ = runner.decode([live], [tok])
                tok = int(logits[0].argmax())
                out.append(tok)
            again = runner.open_session(session_id="again")
            job = runner.start_prefill(again, shared + prompt_ids(3, seed=10), KEY)
            out.append(job.cached)
            while (first := job.step(64)) is None:
                pass
            out.append(first.argmax().item())
        assert after[0] == after[1] and after[0][4] > 0  # a hit
