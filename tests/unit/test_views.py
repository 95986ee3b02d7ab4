"""One shape per datum: the heartbeat's fields reach the policies' view by name, and a worker's and the
simulator's records of a request give every field of the request's wire shape."""

from dataclasses import fields

from llmesh.engine.worker import HeldRequest
from llmesh.policies import WorkerView
from llmesh.policies.views import HEARTBEAT_ONLY, worker_view
from llmesh.wire.messages import RequestProgress, WorkerInfo
from llmesh_sim.engine import SimRequest


def test_every_heartbeat_field_is_viewed_or_declared_heartbeat_only():
    viewed = {f.name for f in fields(WorkerView)}
    heartbeat = set(WorkerInfo.model_fields)
    assert heartbeat - viewed == HEARTBEAT_ONLY, "a new heartbeat field: add it to WorkerView or to HEARTBEAT_ONLY"


def test_the_view_carries_each_heartbeat_value():
    request = RequestProgress(
        request_id="r",
        prompt_tokens=30,
        generated=2,
        max_tokens=9,
        predicted_tokens=7.5,
        priority=1,
        migrating=True,
        predicted_remaining=4.0,
        remaining_at=2,
    )
    info = WorkerInfo(
        worker_id="d",
        role="decode",
        model="m",
        fingerprint="f",
        max_model_len=2048,
        running=1,
        queued_tokens=7,
        capacity=4,
        heartbeat_s=1.0,
        prefill_tokens_per_s=900.0,
        generates=True,
        state="draining",
        kv_blocks_used=3,
        kv_blocks_total=50,
        block_size=16,
        requests=[request],
        roles=["prefill", "decode"],
        loaded_adapters=["sql"],
    )
    view = worker_view(info)
    for name in set(WorkerInfo.model_fields) - HEARTBEAT_ONLY - {"requests", "roles", "loaded_adapters"}:
        assert getattr(view, name) == getattr(info, name), name
    assert view.requests == (request,) and view.roles == ("prefill", "decode")
    assert view.loaded_adapters == frozenset({"sql"})


def test_a_workers_and_the_simulators_request_records_give_every_field_of_its_wire_shape():
    for record in (HeldRequest, SimRequest):
        names = {f.name for f in fields(record)} | {n for n in dir(record) if isinstance(getattr(record, n), property)}
        assert set(RequestProgress.model_fields) <= names, (record.__name__, set(RequestProgress.model_fields) - names)
    held = HeldRequest("r", task=None, queued_tokens=0, prompt_tokens=30, max_tokens=9, generated=2, priority=1)
    held.predicted_remaining, held.remaining_at = 4.0, 2
    assert held.progress() == RequestProgress(
        request_id="r",
        prompt_tokens=30,
        generated=2,
        max_tokens=9,
        priority=1,
        predicted_remaining=4.0,
        remaining_at=2,
    )
    simulated = SimRequest("s", arrival=0.0, prompt_tokens=30, output_tokens=9, generated=2)
    assert RequestProgress.model_validate(simulated, from_attributes=True).max_tokens == 9
