import asyncio

import pytest

from llmesh.policies import RequestView
from llmesh.wire.errors import AtCapacity, Overloaded, ServiceUnavailable, Timeout
from llmesh_router.admission import AdmissionQueue


def rv(name, deadline=1e12, arrival=0.0, **kw):
    return RequestView(name, "m", prompt_tokens=10, arrival=arrival, deadline=deadline, **kw)


def drained(queue, gap_s, n=8):
    """The queue has been releasing one request every `gap_s` (n departures)."""
    queue._gaps.extend([gap_s] * n)
    return queue


class Slots:
    """`place` for the queue: a slot if one is free, else AtCapacity."""

    def __init__(self, free=0):
        self.free, self.given = free, []

    def placer(self, name):
        def place():
            if self.free <= 0:
                raise AtCapacity("full")
            self.free -= 1
            self.given.append(name)
            return name

        return place


async def test_waiters_are_placed_in_arrival_order_as_room_appears():
    now = [0.0]
    queue, slots = AdmissionQueue(max_waiting=8, max_wait_s=10, clock=lambda: now[0]), Slots()
    waits = [asyncio.create_task(queue.admit(slots.placer(n), rv(n, deadline=100))) for n in ("a", "b", "c")]
    await asyncio.sleep(0)
    assert len(queue) == 3
    for t in (1.0, 3.0):
        now[0] = t
        slots.free += 1
        queue.room_changed()
    await asyncio.sleep(0)
    assert slots.given == ["a", "b"] and len(queue) == 1
    assert await waits[0] == ("a", True)
    assert queue.interval_s == pytest.approx(1.5)  # departures at 1 s (since 0) and 3 s
    waits[2].cancel()  # a client that leaves frees its place in line
    await asyncio.sleep(0)
    assert len(queue) == 0


async def test_nobody_waiting_and_room_is_immediate():
    queue, slots = AdmissionQueue(max_waiting=0, max_wait_s=1), Slots(free=1)
    assert await queue.admit(slots.placer("a"), rv("a")) == ("a", False)


async def test_a_hopeless_deadline_is_refused_up_front_with_a_retry_hint():
    now = [0.0]
    queue, slots = AdmissionQueue(max_waiting=8, max_wait_s=10, clock=lambda: now[0]), Slots()
    drained(queue, 1.0)
    waiting = asyncio.create_task(queue.admit(slots.placer("a"), rv("a", deadline=100)))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="past this request's deadline") as refused:
        await queue.admit(slots.placer("b"), rv("b", deadline=1.5))  # 2 s of queue ahead of it
    # in 1 s the queue ahead has drained enough for its wait to fit in its deadline
    assert refused.value.retry_after_s == 1 and refused.value.http_status == 429
    waiting.cancel()


async def test_a_wait_expected_past_the_longest_is_refused_up_front_not_after_it():
    now = [0.0]
    queue, slots = AdmissionQueue(max_waiting=8, max_wait_s=2.5, clock=lambda: now[0]), Slots()
    drained(queue, 1.0)
    ahead = [asyncio.create_task(queue.admit(slots.placer(n), rv(n))) for n in ("a", "b")]
    await asyncio.sleep(0)
    assert len(queue) == 2  # expected waits 1 s and 2 s: both within 2.5 s
    with pytest.raises(Overloaded, match=r"the router's longest wait \(2.5s\)") as refused:
        await queue.admit(slots.placer("c"), rv("c"))  # 3 s
    assert refused.value.retry_after_s == 1  # 0.5 s more than the longest wait, rounded up to a second
    for waiting in ahead:
        waiting.cancel()


async def test_once_a_waiter_finds_no_room_the_rest_of_its_group_wait_untried():
    queue, tried = AdmissionQueue(max_waiting=8, max_wait_s=10), []

    def full(name):
        def place():
            tried.append(name)
            raise AtCapacity("full")

        return place

    waits = [
        asyncio.create_task(queue.admit(full(n), rv(n), group))
        for n, group in [("a", "prefill"), ("b", "prefill"), ("c", "decode"), ("d", None), ("e", None)]
    ]
    await asyncio.sleep(0)
    tried.clear()
    queue.room_changed()
    assert tried == ["a", "c", "d", "e"]  # b would look where a found nothing; ungrouped ones are all tried
    for waiting in waits:
        waiting.cancel()


async def test_an_error_other_than_capacity_fails_the_waiter_at_once():
    queue = AdmissionQueue(max_waiting=8, max_wait_s=10)
    broken = [False]

    def place():
        if broken[0]:
            raise ServiceUnavailable("its workers are gone")
        raise AtCapacity("full")

    waiting = asyncio.create_task(queue.admit(place, rv("a")))
    await asyncio.sleep(0)
    broken[0] = True
    queue.room_changed()
    with pytest.raises(ServiceUnavailable, match="gone"):
        await waiting


async def test_the_queue_policy_orders_waiters_and_refuses_the_hopeless():
    from llmesh.policies import make_queue_policy

    now = [10.0]
    queue = AdmissionQueue(
        max_waiting=8, max_wait_s=100, policy=make_queue_policy("edf"), service_s=lambda r: 1.0, clock=lambda: now[0]
    )
    slots = Slots()
    relaxed = asyncio.create_task(queue.admit(slots.placer("relaxed"), rv("relaxed", arrival=9.0, ttft_slo_s=30.0)))
    urgent = asyncio.create_task(queue.admit(slots.placer("urgent"), rv("urgent", arrival=10.0, ttft_slo_s=5.0)))
    doomed = asyncio.create_task(queue.admit(slots.placer("doomed"), rv("doomed", arrival=8.0, ttft_slo_s=2.5)))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="time-to-first-token target"):
        await doomed  # due at 10.5, and 1 s of service from now is 11
    slots.free = 1
    queue.room_changed()
    assert await urgent == ("urgent", True)  # arrived last, due first
    assert slots.given == ["urgent"] and len(queue) == 1
    relaxed.cancel()


@pytest.mark.parametrize("hosts, refused", [({"a": "h1", "b": "h1"}, 1), ({"a": "h1", "b": "h2"}, 0)])
async def test_the_policy_schedules_each_hosts_queue_apart(hosts, refused):
    """Prism's queue per device: Moore-Hodgson over requests that share workers. Three 1 s requests due
    1.5, 1.5 and 2.5 s from now cannot all be served in time by one host; b's, alone on h2, can."""
    from llmesh.policies import make_queue_policy

    queue = AdmissionQueue(
        max_waiting=8,
        max_wait_s=100,
        policy=make_queue_policy("prism-refuse"),
        service_s=lambda r: 1.0,
        clock=lambda: 10.0,
        queue_of=hosts.get,
    )
    slots = Slots()
    waiting = [
        asyncio.create_task(queue.admit(slots.placer(name), RequestView(name, model, 10, 10.0, 1e12, ttft_slo_s=slo)))
        for name, model, slo in (("a1", "a", 1.5), ("b1", "b", 1.5), ("a2", "a", 2.5))
    ]
    done, _ = await asyncio.wait(waiting, timeout=0.1)
    assert sum(isinstance(t.exception(), Overloaded) for t in done) == refused
    for task in waiting:
        task.cancel()


async def test_a_committed_request_is_placed_first_and_never_refused_for_waiting():
    """A decode (its client has its first token) is not refused by a full queue or a long expected wait,
    goes ahead of the prompts waiting, and only its deadline ends its wait (Timeout, not 429)."""
    now = [0.0]
    queue, slots = drained(AdmissionQueue(max_waiting=1, max_wait_s=1.5, clock=lambda: now[0]), 1.0), Slots()
    prompt = asyncio.create_task(queue.admit(slots.placer("prompt"), rv("prompt", arrival=0.0)))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded, match="queue is full"):
        await queue.admit(slots.placer("late"), rv("late"))
    decode = asyncio.create_task(queue.admit(slots.placer("decode"), rv("decode", arrival=5.0), committed=True))
    doomed = asyncio.create_task(
        queue.admit(slots.placer("doomed"), rv("doomed", arrival=6.0, deadline=0.05), committed=True)
    )
    await asyncio.sleep(0)
    assert len(queue) == 3
    slots.free = 1
    queue.room_changed()
    assert await decode == ("decode", True) and slots.given == ["decode"]  # arrived last, past its prompt
    with pytest.raises(Timeout, match="before its deadline"):
        await doomed
    slots.free = 1
    queue.room_changed()
    assert await prompt == ("prompt", True)


async def test_retry_after_follows_the_drain_rate_over_bursts_and_stays_within_the_longest_wait():
    """Workers free slots in bursts (8 at once, then 1 s of nothing): the estimated wait is the mean
    over the window, not the last gap, and a refusal's Retry-After is never longer than max_wait_s."""
    now = [0.0]
    queue = AdmissionQueue(max_waiting=1000, max_wait_s=5, clock=lambda: now[0])
    slots = Slots()
    waits = [asyncio.create_task(queue.admit(slots.placer(f"r{i}"), rv(f"r{i}"))) for i in range(80)]
    await asyncio.sleep(0)
    estimates = []
    for burst in range(1, 5):
        now[0] = float(burst)
        slots.free = 8
        queue.room_changed()
        estimates.append(queue.interval_s)
    assert estimates == pytest.approx([1 / 8] * 4)  # 8 left each second, whichever gap came last
    with pytest.raises(Overloaded) as refused:  # 48 ahead: ~6 s
        await queue.admit(slots.placer("x"), rv("x", deadline=now[0] + 0.01))
    assert refused.value.retry_after_s == 5  # by then every request waiting now has left the queue
    for waiting in waits:
        waiting.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
