"""The router's scheduler follows the registry: a heartbeat replaces what it assumed since the last one,
a worker that left is forgotten (llmesh_router.scheduler)."""

import asyncio

import pytest

from llmesh.policies import RequestView, make_policy
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import ModelNotFound, ServiceUnavailable
from llmesh.wire.messages import WorkerInfo
from llmesh_router.registry import WorkerRegistry
from llmesh_router.scheduler import Scheduler


def info(worker_id, running=0):
    return WorkerInfo(
        worker_id=worker_id,
        role="prefill",
        model="m",
        fingerprint="f" * 32,
        max_model_len=2048,
        running=running,
        queued_tokens=0,
        capacity=2,
        heartbeat_s=1.0,
    )


def request(request_id, hashes=()):
    return RequestView(request_id, "m", prompt_tokens=100, arrival=0.0, deadline=60.0, prefix_hashes=hashes)


def test_reservations_last_until_the_next_heartbeat_and_a_worker_that_left_is_forgotten():
    now = [0.0]
    registry = WorkerRegistry(missed_heartbeats=3, clock=lambda: now[0])
    scheduler = Scheduler(registry, make_policy("cache_aware"), clock=lambda: now[0])
    registry.on_heartbeat(info("a"))
    scheduler.pick("prefill", request("r1", (1, 2)))
    assert scheduler.view(registry.get("a")).assigned == 1 and scheduler.backlog("a") == 100
    registry.on_heartbeat(info("a", running=1))  # it counts the request now
    view = scheduler.view(registry.get("a"))
    assert (view.assigned, view.running, view.sent_backlog) == (0, 1, 100)  # the prompt is still this router's
    scheduler.token_gap("a", 0.01)
    assert scheduler._prefixes is not None and scheduler._prefixes.matches(["a"], (1, 2)).get("a")
    now[0] = 10.0
    registry.expire()
    assert registry.get("a") is None and "a" not in scheduler._token_gaps
    registry.on_heartbeat(info("b"))
    registry.on_heartbeat(info("a"))
    # the prefix index forgot where r1's blocks went: b is as good as a
    assert not scheduler._prefixes.matches(["a", "b"], (1, 2)).get("a")


def test_the_kv_blocks_of_prompts_sent_since_the_heartbeat_are_in_the_view_until_the_next():
    registry = WorkerRegistry(missed_heartbeats=3)
    scheduler = Scheduler(registry, make_policy("llumnix"))
    beat = info("a").model_copy(update={"kv_blocks_total": 100, "block_size": 16, "capacity": 8})
    registry.on_heartbeat(beat)
    scheduler.pick("prefill", request("r1"))
    scheduler.pick("prefill", request("r2"))
    view = scheduler.view(registry.get("a"))
    assert (view.assigned, view.assigned_blocks) == (2, 2 * 7)  # 100 prompt tokens and the first output: 7 blocks
    registry.on_heartbeat(beat)
    assert scheduler.view(registry.get("a")).assigned_blocks == 0


async def test_a_request_for_a_model_no_worker_serves_waits_for_one_apart_from_the_queue():
    """Parked: the queue's estimates (about requests that have workers) neither refuse it nor count it
    ahead of others; a worker of its model joining places it; an unknown model is refused at once."""
    now = [0.0]
    registry = WorkerRegistry(catalogue=[ServedModel(name="m"), ServedModel(name="n")], clock=lambda: now[0])
    scheduler = Scheduler(registry, max_wait_s=1.0, model_wait_s=30.0, clock=lambda: now[0])
    queue = scheduler.admission
    queue._gaps.extend([5.0] * 8)  # the queue drains a request every 5 s: past max_wait_s for anyone behind one
    parked = asyncio.create_task(scheduler.admit("prefill", RequestView("r-n", "n", 100, arrival=0.0, deadline=1e12)))
    await asyncio.sleep(0)
    assert len(queue) == 1 and not parked.done() and queue._waiting[0].parked
    registry.on_heartbeat(info("a"))  # a worker of m has room: m's request is placed at once, n's waits on
    worker, waited = await scheduler.admit("prefill", request("r-m"))
    assert (worker.worker_id, waited) == ("a", False)
    with pytest.raises(ModelNotFound):
        await scheduler.admit("prefill", RequestView("r-x", "x", 100, arrival=0.0, deadline=1e12))
    registry.on_heartbeat(info("b").model_copy(update={"model": "n"}))
    worker, waited = await asyncio.wait_for(parked, 1)
    assert (worker.worker_id, waited) == ("b", True)


async def test_a_parked_request_ends_with_a_503_after_the_models_wait():
    registry = WorkerRegistry(catalogue=[ServedModel(name="m")])
    scheduler = Scheduler(registry, model_wait_s=0.05, clock=lambda: 0.0)
    with pytest.raises(ServiceUnavailable, match="no worker served 'm' within 0.1s"):
        await scheduler.admit("prefill", request("r1"))
    assert len(scheduler.admission) == 0


async def test_an_aggregated_models_request_runs_whole_on_a_decode_worker_its_prompt_in_that_backlog():
    registry = WorkerRegistry(catalogue=[ServedModel(name="m", disaggregated=False), ServedModel(name="n")])
    scheduler = Scheduler(registry, clock=lambda: 0.0)
    decode = info("d").model_copy(update={"role": "decode", "host": "h2"})
    registry.on_heartbeat(decode)  # runs no whole requests: not for m
    registry.on_heartbeat(info("g").model_copy(update={"role": "decode", "host": "h3", "generates": True}))
    registry.on_heartbeat(info("p").model_copy(update={"host": "h1"}))  # a prefill worker of m, started by hand
    worker, waited = await scheduler.admit("decode", request("r1"), generates=True)
    assert (worker.worker_id, waited, scheduler.backlog("g")) == ("g", False, 100)
    assert scheduler.hosts_of("m") == ("h2", "h3")  # its queue: where its prompts run
    assert registry.served() == ["m"]  # n has no workers; m needs decode workers only
    registry.on_heartbeat(decode.model_copy(update={"worker_id": "n-d", "model": "n"}))
    assert registry.served() == ["m"]  # n needs a prefill worker too


async def test_a_reservation_gives_back_every_slot_prompt_and_claim_it_took_however_it_ends():
    registry = WorkerRegistry(missed_heartbeats=3)
    scheduler = Scheduler(registry, clock=lambda: 0.0)
    registry.on_heartbeat(info("p"))
    registry.on_heartbeat(info("d").model_copy(update={"role": "decode"}))
    registry.on_heartbeat(info("t").model_copy(update={"role": "decode"}))

    def held() -> dict[str, tuple[int, int, int]]:
        """Each worker's slots held (assigned - released), its backlog, and the model's claims."""
        load = scheduler._load
        return {w: (load[w].assigned - load[w].released, scheduler.backlog(w), scheduler._claims["m"]) for w in "pdt"}

    with pytest.raises(RuntimeError), scheduler.reservation("m") as reservation:
        await reservation.admit("prefill", request("r1"), claim_decode=True)
        assert held()["p"] == (1, 100, 1)
        reservation.release("p")  # the prefill is done: its prompt is out of the backlog, the claim stays
        assert held()["p"] == (0, 0, 1)
        decode, _ = await reservation.admit("decode", request("r1"))
        assert held()[decode.worker_id] == (1, 0, 0)  # the decode's admission gave the claim back
        reservation.hold("t")  # a migration's target, beside its source
        raise RuntimeError("the client left mid-stream")
    assert set(held().values()) == {(0, 0, 0)}
    with scheduler.reservation("m") as reservation:  # a prefill that ends before its decode is placed
        await reservation.admit("prefill", request("r2"), claim_decode=True)
    assert set(held().values()) == {(0, 0, 0)}
