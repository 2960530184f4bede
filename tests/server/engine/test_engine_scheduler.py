"""The Scheduler alone: no runner, no engine thread. Its plans (what an iteration drops, its prompt-token
budget), who gets the next prompt chunk (first come first served, the batch's room, n choices), withdrawal,
and the queue's gate."""

from __future__ import annotations

import asyncio

import pytest

from retopk_server.engine import EngineConfig, EngineError, ErrorCode, GenerationRequest, RequestStream
from retopk_server.engine.scheduler import Scheduler
from retopk_server.engine.turn import ActiveRequest


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def request(loop, name: str, n: int = 1, deadline: float | None = None) -> ActiveRequest:
    return ActiveRequest(GenerationRequest(name, text=name, n=n, deadline=deadline), RequestStream(loop), 4)


def queued(scheduler: Scheduler, *requests: ActiveRequest) -> None:
    with scheduler.lock:
        for r in requests:
            scheduler.check_open()
            scheduler.enqueue(r)


def admit(scheduler: Scheduler) -> ActiveRequest:
    """The next request through admission into the batch, as the loop moves it once its prompt is in."""
    r = scheduler.next_prefill()
    assert r is not None
    scheduler.joined(r, [r])
    return r


def test_the_queue_is_served_in_order_while_the_batch_has_room(loop):
    scheduler = Scheduler(EngineConfig(max_running=2))
    a, b, c = (request(loop, x) for x in "abc")
    queued(scheduler, a, b, c)
    assert scheduler.next_prefill() is a
    assert scheduler.next_prefill() is a  # being admitted: it gets every chunk until its prompt is in
    assert scheduler.load() == (2, 1)
    scheduler.joined(a, [a])
    assert admit(scheduler) is b
    assert scheduler.next_prefill() is None  # the batch is full: c waits
    assert scheduler.running == [a, b] and list(scheduler.queue) == [c]
    a.done = True
    scheduler.keep_going(scheduler.running)
    assert scheduler.next_prefill() is c


def test_one_iteration_admits_several_requests_while_the_batch_has_room_for_all_of_them(loop):
    """The loop feeds an iteration's chunks in one forward: next_prefill hands out one request after another
    (``fed``: those given a chunk in this iteration), counting the admitted ones' rows against the batch."""
    scheduler = Scheduler(EngineConfig(max_running=4))
    a, b, c, d = request(loop, "a"), request(loop, "b", n=2), request(loop, "c"), request(loop, "d")
    queued(scheduler, a, b, c, d)
    assert scheduler.next_prefill([]) is a and scheduler.next_prefill([a]) is b and scheduler.next_prefill([a, b]) is c
    assert scheduler.next_prefill([a, b, c]) is None  # 1 + 2 + 1 rows: full
    assert scheduler.admitting == [a, b, c] and scheduler.load() == (1, 3)
    scheduler.joined(a, [a])
    scheduler.joined(b, [b, request(loop, "b fork")])
    assert scheduler.next_prefill([]) is c  # still admitted (its prompt did not fit): it goes first
    assert scheduler.next_prefill([c]) is None and scheduler.in_flight() == 5  # d queued, 3 rows, c


def test_n_choices_wait_for_room_for_all_of_them_and_nothing_overtakes_them(loop):
    scheduler = Scheduler(EngineConfig(max_running=3))
    first, wide, small = request(loop, "first"), request(loop, "wide", n=3), request(loop, "small")
    queued(scheduler, first, wide, small)
    admit(scheduler)
    assert scheduler.next_prefill() is None  # 1 + 3 > 3, and "small" behind it does not go first
    first.done = True
    scheduler.keep_going(scheduler.running)
    assert scheduler.next_prefill() is wide  # alone in an empty batch


def test_an_empty_batch_takes_a_request_wider_than_the_batch(loop):
    scheduler = Scheduler(EngineConfig(max_running=2))
    wide = request(loop, "wide", n=5)
    queued(scheduler, wide)
    assert scheduler.next_prefill() is wide


@pytest.mark.parametrize("running, budget", [(0, 10), (3, 7), (10, 1), (12, 1)])
def test_the_prompt_budget_is_what_the_decode_tokens_leave_and_at_least_one(loop, running, budget):
    scheduler = Scheduler(EngineConfig(max_step_tokens=10, max_running=16))
    scheduler.running = [request(loop, str(i)) for i in range(running)]
    plan = scheduler.plan(now=0.0)
    assert plan.dropped == [] and plan.prefill_tokens == budget


def test_the_plan_drops_cancelled_and_expired_requests_from_the_batch_and_the_queue(loop):
    scheduler = Scheduler(EngineConfig(max_step_tokens=10))
    late, cancelled, fine = request(loop, "late", deadline=5.0), request(loop, "cancelled"), request(loop, "fine")
    both = request(loop, "both", deadline=5.0)
    queued(scheduler, late, fine)
    admit(scheduler)
    queued(scheduler, cancelled, both)
    cancelled.stream.cancel()
    plan = scheduler.plan(now=4.0)
    assert [(r, e.code) for r, e in plan.dropped] == [(cancelled, ErrorCode.CANCELLED)]
    assert plan.dropped[0][1].message.endswith("while queued")
    both.stream.cancel()
    plan = scheduler.plan(now=6.0)
    assert [(r, e.code) for r, e in plan.dropped] == [(late, ErrorCode.DEADLINE_EXCEEDED),  # running
                                                      (both, ErrorCode.DEADLINE_EXCEEDED)]  # before its cancel
    assert scheduler.running == [] and list(scheduler.queue) == [fine] and plan.prefill_tokens == 10


def test_a_withdrawn_request_leaves_the_queue_but_an_admitted_one_stays(loop):
    scheduler = Scheduler(EngineConfig())
    a, b = request(loop, "a"), request(loop, "b")
    queued(scheduler, a, b)
    assert scheduler.next_prefill() is a
    assert not scheduler.withdraw(a) and scheduler.withdraw(b)
    assert list(scheduler.queue) == [] and scheduler.in_flight() == 1
    scheduler.abandon(a)
    assert scheduler.admitting == [] and scheduler.in_flight() == 0


def test_a_finished_request_no_longer_counts_as_in_flight(loop):
    scheduler = Scheduler(EngineConfig())
    a = request(loop, "a")
    queued(scheduler, a)
    admit(scheduler)
    assert scheduler.in_flight() == 1
    a.done = True  # its last event is out; the loop drops it after its step
    assert scheduler.in_flight() == 0 and scheduler.load() == (0, 1)


@pytest.mark.parametrize("state, code", [("draining", ErrorCode.UNAVAILABLE), ("stopped", ErrorCode.UNAVAILABLE),
                                         ("full", ErrorCode.RESOURCE_EXHAUSTED)])
def test_the_queue_refuses_while_draining_stopped_or_full(loop, state, code):
    scheduler = Scheduler(EngineConfig(max_queue=1))
    if state == "full":
        queued(scheduler, request(loop, "a"))
    else:
        setattr(scheduler, state, True)
    with scheduler.lock, pytest.raises(EngineError) as refused:
        scheduler.check_open()
    assert refused.value.code is code
