"""Several sessions' prompt chunks in one forward (runner.prefill_together, prefill.py's step_together) against
each session's own ``job.step``: the same logits, KV, method state and tokens, to float32 rounding (a GEMM over
more rows may sum in another order), for first prompts, a later turn, a prompt longer than a chunk and a prompt
fed in two calls; the next decode step agrees too. A forward that fails for one session is retried session by
session, so that only that session stops."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
import torch.nn.functional as F
from runtime_helpers import prompt_ids, runner_for, tiny_model

from retopk_server.engine import Engine, GenerationRequest, RequestStream
from retopk_server.engine.requests import EngineConfig
from retopk_server.runtime import MethodSpec, attention
from retopk_server.runtime.attention import PrefillContext
from tests.server.fake_runner import FakeTokenizer

# float32 throughout: only the order of a GEMM's sums differs between one session's forward and a shared one
ATOL = 1e-5
METHODS = [
    MethodSpec("full"),
    # no dense floor: the prefill seeds ReTopK's FIFOs from the prompt's last queries
    MethodSpec.of("retopk", top_k=8, cache_size=6, window=2, tau=0.85, tau_calibration=0.8, dense_below=0),
    MethodSpec.of("quest", top_k=8, page_size=4),
]
EARLIER = prompt_ids(9, seed=10)  # session 1's first turn, prefilled alone before
# per session: the prompt, and the tokens the first call feeds (the rest in a second call)
PLAN = [(prompt_ids(5, seed=11), 5), (prompt_ids(6, seed=12), 6), (prompt_ids(20, seed=13), 20),
        (prompt_ids(13, seed=14), 7)]


def state_of(runner, session) -> list[dict[str, torch.Tensor]]:
    """Per layer, every field of the session's method state as ``read_slot`` exports it (a slot's FIFO rows past its
    fill hold whatever the memory held and are never read)."""
    group = runner.method_group(session.method)
    return [state.read_slot(slot) for state, slot in zip(group.states, session.slots, strict=True)]


def kv_of(runner, session) -> list[torch.Tensor]:
    table = torch.tensor(session.blocks)
    return [torch.cat(runner.pool.history(layer, table, session.length)) for layer in range(runner.info.num_layers)]


def start(method):
    """A runner with chunks of 8 tokens and its four sessions, session 1 holding its earlier turn."""
    runner = runner_for(tiny_model("llama"), method, kv_block_size=4, prefill_chunk=8)
    sessions = [runner.open_session() for _ in PLAN]
    runner.prefill(sessions[1], EARLIER)
    jobs = [runner.start_prefill(s, prompt) for s, (prompt, _) in zip(sessions, PLAN, strict=True)]
    return runner, sessions, jobs


def assert_same(a, b, sa, sb) -> None:
    for x, y in zip(sa, sb, strict=True):
        assert x.token_ids == y.token_ids
        for kx, ky in zip(kv_of(a, x), kv_of(b, y), strict=True):
            torch.testing.assert_close(kx, ky, atol=ATOL, rtol=0)
        for fx, fy in zip(state_of(a, x), state_of(b, y), strict=True):
            for name in fx:
                if fx[name].is_floating_point():
                    torch.testing.assert_close(fx[name], fy[name], atol=ATOL, rtol=0, msg=name)
                else:
                    assert torch.equal(fx[name], fy[name]), name


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_shared_forwards_give_each_session_what_it_gets_alone(method):
    alone, alone_sessions, alone_jobs = start(method)
    expected = [job.step(n) for job, (_, n) in zip(alone_jobs, PLAN, strict=True)]
    expected.append(alone_jobs[3].step(alone_jobs[3].remaining))

    shared, sessions, jobs = start(method)
    forwards = []
    real = shared.forward
    shared.forward = lambda ctx, *a, **kw: forwards.append(len(ctx.segments)) or real(ctx, *a, **kw)
    got = shared.prefill_together([(job, n) for job, (_, n) in zip(jobs, PLAN, strict=True)])
    got += shared.prefill_together([(jobs[3], jobs[3].remaining)])
    shared.forward = real
    # chunks of at most 8 per session: 4 sessions, then the 20-token prompt's 2nd and 3rd chunks, then the rest
    assert forwards == [4, 1, 1, 1]
    assert got[3] is None and expected[3] is None  # its first call ends before its prompt does
    for g, e in zip(got[:3] + got[4:], expected[:3] + expected[4:], strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=0)
    assert_same(shared, alone, sessions, alone_sessions)
    tokens = [int(e.argmax()) for e in expected[:3]] + [int(expected[4].argmax())]
    step_alone, _ = alone.decode(alone_sessions, tokens)
    step_shared, _ = shared.decode(sessions, tokens)
    torch.testing.assert_close(step_shared, step_alone, atol=ATOL, rtol=0)


def test_a_forward_that_fails_for_one_session_stops_that_session_alone(monkeypatch):
    method = METHODS[1]
    alone, alone_sessions, alone_jobs = start(method)
    shared, sessions, jobs = start(method)
    bad = sessions[2]
    real = attention._prefill

    def failing(seg, layer, *rest):
        if seg.slots == bad.slots and layer == 1:
            raise RuntimeError("this session's attention failed")
        return real(seg, layer, *rest)

    monkeypatch.setattr(attention, "_prefill", failing)
    got = shared.prefill_together([(job, job.remaining) for job in jobs])
    assert isinstance(got[2], RuntimeError) and all(isinstance(g, torch.Tensor) for g in got[:2] + got[3:])
    jobs[2].abort()
    assert bad.length == 0 and bad.token_ids == []
    monkeypatch.setattr(attention, "_prefill", real)
    expected = [job.step(job.remaining) for job in alone_jobs]
    for i in (0, 1, 3):
        torch.testing.assert_close(got[i], expected[i], atol=ATOL, rtol=0)
    keep = [0, 1, 3]
    assert_same(shared, alone, [sessions[i] for i in keep], [alone_sessions[i] for i in keep])


def test_requests_that_arrive_together_share_a_forward_unless_one_starts_with_what_another_will_cache():
    """Through the engine (blocks and chunks of 4): two requests queued in one iteration that share a system
    prompt go one after the other, and the second takes the system prompt's blocks from the cache, as it does when
    it comes after the first; three requests that share nothing cacheable (other salts, other tokens) go in one
    forward and find nothing cached."""
    runner = runner_for(tiny_model("llama", max_positions=1024), kv_block_size=4, prefill_chunk=4)
    runner.tokenizer = FakeTokenizer()
    forwards = []  # jobs per runner.prefill_together
    prefill_together = runner.prefill_together
    runner.prefill_together = lambda plan: forwards.append(len(plan)) or prefill_together(plan)
    # the engine thread is held in an idle pass (trim_pools) while the test queues requests that arrive together
    holds: list[tuple[threading.Event, threading.Event]] = []  # (the engine is held, let it go)
    trim_pools = runner.trim_pools

    def held_trim():
        if holds:
            held, go = holds.pop()
            held.set()
            go.wait(30)
        return trim_pools()

    runner.trim_pools = held_trim
    engine = Engine(lambda: runner, EngineConfig(max_running=4, idle_wait_s=0.02))
    engine.start()
    system, other = prompt_ids(24, seed=2), prompt_ids(29, seed=3)

    async def finish(stream):
        final = None
        async for event in stream:
            final = event
        return final.usage.cached_tokens

    async def together(*requests):
        """Queue (salt, tokens) requests in one idle pass of the engine -> each one's cached tokens."""
        forwards.clear()
        held, go = threading.Event(), threading.Event()
        holds.append((held, go))
        await asyncio.to_thread(held.wait, 30)
        streams = []
        for i, (salt, ids) in enumerate(requests):
            streams.append(RequestStream())
            engine.submit(GenerationRequest(f"{salt}{i}", token_ids=ids, max_new_tokens=2, cache_salt=salt),
                          streams[-1])
        go.set()
        return list(await asyncio.gather(*map(finish, streams)))

    def ask(salt, question):
        return salt, system + prompt_ids(5, seed=question)

    try:
        alike = asyncio.run(together(ask("a", 10), ask("a", 11)))
        assert forwards == [1, 1]
        one_after_another = [asyncio.run(together(ask("b", 10)))[0], asyncio.run(together(ask("b", 11)))[0]]
        assert alike == one_after_another and alike[0] == 0 and alike[1] > 0
        assert asyncio.run(together(ask("c", 10), ask("d", 11), ("c", other))) == [0, 0, 0]
        assert forwards == [3]
    finally:
        for _, go in holds:
            go.set()
        engine.stop()


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16"])
def test_a_shared_attention_is_each_sessions_dense_attention_over_its_stored_keys_bit_for_bit(kv_dtype):
    """PrefillContext.attend over several sessions' chunks (first prompts and a later turn; the new keys rounded
    once for all of them as the pool stores them) against each session's own causal SDPA over the keys and values
    its pool holds afterwards (``history``), on the same q: equal bit for bit, and the kept queries are the chunk's
    own (attention is per session; only the GEMMs around it see the other sessions' rows)."""
    runner = runner_for(tiny_model("llama"), METHODS[1], kv_block_size=4, prefill_chunk=8, kv_dtype=kv_dtype)
    sessions = [runner.open_session() for _ in PLAN]
    runner.prefill(sessions[1], EARLIER)
    jobs = [runner.start_prefill(s, prompt) for s, (prompt, _) in zip(sessions, PLAN, strict=True)]
    ends = [min(job.end, job.pos + 8) for job in jobs]
    offsets = [0]
    for job, end in zip(jobs, ends, strict=True):
        offsets.append(offsets[-1] + end - job.pos)
    H, H_kv, d = runner.info.num_heads, runner.info.num_kv_heads, runner.info.head_dim
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, offsets[-1], d, generator=g) for h in (H, H_kv, H_kv))
    ctx = PrefillContext([job._segment(end, at) for job, end, at in zip(jobs, ends, offsets[:-1], strict=True)])
    out = ctx.attend(0, q, k, v, 0.25)  # (1, H, N, d)
    for job, seg, a, b in zip(jobs, ctx.segments, offsets[:-1], offsets[1:], strict=True):
        s, L = job.pos, job.pos + b - a
        keys, values = (t.unsqueeze(0).float() for t in runner.pool.history(0, torch.tensor(job.session.blocks), L))
        mask = torch.arange(L).view(1, L) <= torch.arange(s, L).view(-1, 1)  # (T, L): causal over the history
        expected = F.scaled_dot_product_attention(q[:, :, a:b], keys, values, attn_mask=None if s == 0 else mask,
                                                  is_causal=s == 0, scale=0.25, enable_gqa=True)
        assert torch.equal(out[:, :, a:b], expected), job.session.session_id
        first = max(seg.tail_start, s)  # the first position whose query the method observes, if in this chunk
        assert torch.equal(seg.kept[0], q[0, :, a + first - s:b]) if first < L else 0 not in seg.kept
