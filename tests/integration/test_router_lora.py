"""LoRA adapters at the router, in-process on a real nats-server with workers that only answer commands: the
adapters it lists (vLLM's cards, with `parent`), what a request naming one becomes (the model it adapts and the
adapter), and vLLM's admin endpoints that load and unload one on every worker of its model."""

from __future__ import annotations

import httpx
import pytest

from llmesh.policies import RequestView
from llmesh.wire.bus import Bus
from llmesh.wire.config import ServedModel
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import Ack, LoraAdapter, LoraCommand, Subjects
from llmesh_router.auth import KeyRing
from llmesh_router.dispatch import Dispatcher
from llmesh_router.lengths import LengthTagger
from llmesh_router.metrics import RouterMetrics
from llmesh_router.registry import WorkerRegistry
from llmesh_router.scheduler import Scheduler
from llmesh_router.service import create_app

from .test_router import info

pytestmark = pytest.mark.timeout(30)
SQL = LoraAdapter(name="sql", path="/adapters/sql")
CATALOGUE = [ServedModel(name="m", lora_modules=[SQL]), ServedModel(name="n")]
ADMIN, CLIENT = "sk-admin", "sk-client"


@pytest.fixture
async def router(nats_url):
    registry = WorkerRegistry(catalogue=CATALOGUE)
    scheduler = Scheduler(registry, model_wait_s=0)
    bus = await Bus.connect(nats_url, "router-test")
    metrics = RouterMetrics()
    app = create_app(
        Dispatcher(bus, scheduler, LengthTagger(bus, metrics, timeout_s=0.1), metrics),
        registry,
        metrics,
        request_timeout_s=5,
        keys=KeyRing.load(f"{CLIENT} client", None),
        admin_keys=KeyRing.load(f"{ADMIN} admin", None),
    )
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    try:
        yield registry, scheduler, bus, client
    finally:
        await client.aclose()
        await bus.close()


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_the_catalogues_adapters_are_listed_and_a_request_for_one_runs_on_its_model(router):
    registry, scheduler, _, client = router
    cards = {c["id"]: c for c in (await client.get("/v1/models", headers=as_(CLIENT))).json()["data"]}
    assert set(cards) == {"m", "n", "sql"}
    assert (cards["sql"]["parent"], cards["sql"]["root"]) == ("m", "/adapters/sql") and "parent" not in cards["m"]
    seen: list[RequestView] = []

    async def spy(role, view, *args, **kwargs):
        seen.append(view)
        raise InvalidRequest("seen")

    scheduler.admit = spy  # type: ignore[method-assign]
    answer = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi"}, headers=as_(CLIENT))
    assert answer.status_code == 400 and [(v.model, v.adapter) for v in seen] == [("m", "sql")]
    unknown = await client.post("/v1/completions", json={"model": "nosql", "prompt": "hi"}, headers=as_(CLIENT))
    assert unknown.status_code == 404 and "sql" in unknown.json()["error"]["message"]

    # once a worker of `m` is live, its heartbeats say what it serves
    registry.on_heartbeat(info("d1", role="decode").model_copy(update={"adapters": {"sql": SQL.path, "x": "/x"}}))
    names = [c["id"] for c in (await client.get("/v1/models", headers=as_(CLIENT))).json()["data"]]
    assert names == ["m", "n", "sql", "x"]


async def test_the_admin_endpoints_load_and_unload_on_every_worker_of_the_model_with_an_admin_key(router):
    registry, _, bus, client = router
    commands: dict[str, list[LoraCommand]] = {"d1": [], "d2": []}
    refuse = {"d2": "rank 64 is over max_lora_rank 16"}

    def worker(worker_id: str):
        async def on(cmd: LoraCommand, blob: memoryview) -> Ack:
            commands[worker_id].append(cmd)
            if cmd.op == "load" and worker_id in refuse:
                raise InvalidRequest(refuse[worker_id], param="lora_path")
            return Ack()

        return on

    for worker_id in commands:
        registry.on_heartbeat(info(worker_id, role="decode"))
        await bus.serve(Subjects.lora(worker_id), worker(worker_id))
    load = {"lora_name": "chat", "lora_path": "/adapters/chat", "base_model_name": "m"}
    for headers, status in (({}, 401), (as_(CLIENT), 401)):  # a client's key is not an admin's
        assert (await client.post("/v1/load_lora_adapter", json=load, headers=headers)).status_code == status
    assert commands == {"d1": [], "d2": []}

    refused = await client.post("/v1/load_lora_adapter", json=load, headers=as_(ADMIN))
    assert refused.status_code == 400 and "max_lora_rank" in refused.json()["error"]["message"]
    assert [c.op for c in commands["d1"]] == ["load", "unload"]  # undone where it was taken

    refuse.clear()
    loaded = await client.post("/v1/load_lora_adapter", json=load, headers=as_(ADMIN))
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert all(
        cmds[-1] == LoraCommand(op="load", adapter=LoraAdapter(name="chat", path="/adapters/chat"))
        for cmds in commands.values()
    )
    for worker_id in commands:  # (as their next heartbeats say)
        registry.on_heartbeat(
            info(worker_id, role="decode").model_copy(update={"adapters": {"chat": "/adapters/chat"}})
        )
    again = await client.post("/v1/load_lora_adapter", json=load, headers=as_(ADMIN))
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    clash = await client.post("/v1/load_lora_adapter", json=load | {"lora_name": "n"}, headers=as_(ADMIN))
    assert clash.status_code == 400  # a model's name

    gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=as_(ADMIN))
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"]
    unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}, headers=as_(ADMIN))
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'chat' removed successfully.")
    assert all(cmds[-1].op == "unload" and cmds[-1].adapter.name == "chat" for cmds in commands.values())


async def test_without_admin_keys_the_admin_endpoints_are_closed(nats_url):
    registry = WorkerRegistry(catalogue=CATALOGUE)
    bus = await Bus.connect(nats_url, "router-test")
    metrics = RouterMetrics()
    app = create_app(
        Dispatcher(bus, Scheduler(registry), LengthTagger(bus, metrics, timeout_s=0.1), metrics), registry, metrics, 5
    )
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as client:
            closed = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/a"})
            assert closed.status_code == 403 and "MESH_ADMIN_API_KEYS" in closed.json()["error"]["message"]
    finally:
        await bus.close()
