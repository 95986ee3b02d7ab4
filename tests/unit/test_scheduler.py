"""The router's scheduler follows the registry: a heartbeat replaces what it assumed since the last one,
a worker that left is forgotten (llmesh_router.scheduler)."""

from llmesh.policies import RequestView, make_policy
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
