"""The host agent's pool and activations, with stand-in standbys: real processes that print `ready`, then
record the command they get and run until told to stop (exit 0, as a drained worker does)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from llmesh.deploy.launcher import Child
from llmesh.wire.messages import ActivateCommand
from llmesh_hostagent.service import HostAgent
from llmesh_hostagent.settings import HostAgentSettings

STANDBY = """
import pathlib, sys, time
print("ready", flush=True)
line = sys.stdin.readline()
if not line.strip():
    sys.exit(0)
log = pathlib.Path(sys.argv[1])
log.with_suffix(".command").write_text(line)
while not log.with_suffix(".stop").exists():
    time.sleep(0.05)
"""
CATALOGUE = [
    {"name": "a"},
    {"name": "b", "model": "llmesh/tiny-llama-b"},
    {"name": "wide", "tensor_parallel_size": 2},
    {"name": "whole", "disaggregated": False},
]


def stand_in(role: str, log_path: Path) -> Child:
    return Child(f"standby-{role}", [sys.executable, "-c", STANDBY, str(log_path)], log_path=log_path, keep_stdin=True)


def eventually(predicate, timeout: float = 10) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, f"not within {timeout}s"
        time.sleep(0.05)


@pytest.fixture
def agent(tmp_path, request):
    cold: list[tuple[str, dict, str]] = []

    def start_cold(service, env, log_path, name):
        cold.append((service, env, name))
        return stand_in("cold", log_path)

    standbys, refill_wait_s = getattr(request, "param", (1, 0))
    settings = HostAgentSettings(
        models=CATALOGUE,
        host_id="h1",
        log_dir=tmp_path,
        host_standbys=standbys,
        host_memory_gib=4,
        host_refill_wait_s=refill_wait_s,
    )
    made = HostAgent(None, settings, start=stand_in, start_cold=start_cold)  # type: ignore[arg-type]
    made.cold = cold  # type: ignore[attr-defined]
    made.check()
    try:
        yield made
    finally:
        made.close()


def command(model: str, role: str, worker_id: str, kv_cache_bytes: int = 0) -> ActivateCommand:
    return ActivateCommand(
        command_id=worker_id, model=model, role=role, worker_id=worker_id, kv_cache_bytes=kv_cache_bytes
    )


def test_an_activation_turns_a_ready_standby_into_the_worker_and_the_pool_is_refilled(agent):
    eventually(lambda: agent.info().standbys == {"prefill": 1, "decode": 1})
    standby = agent.standbys["decode"][0]
    outcome = agent.activate(command("b", "decode", "decode-b-1", kv_cache_bytes=3 * 2**30))
    assert (outcome.accepted, outcome.host_id, outcome.reason) == (True, "h1", "from a standby")
    sent = json.loads(eventually_read(standby.log_path.with_suffix(".command")))
    assert sent == {
        "module": "llmesh_decode",
        "env": {
            "MESH_SERVED_MODEL_NAME": "b",
            "MESH_WORKER_ID": "decode-b-1",
            "MESH_HOST_ID": "h1",
            "MESH_KV_CACHE_BYTES": str(3 * 2**30),  # placement's share of the host
        },
    }
    assert agent.standbys["decode"][0] is not standby  # another one started in its place
    eventually(lambda: agent.info().standbys == {"prefill": 1, "decode": 1})
    assert [(w.worker_id, w.model, w.role, w.kv_cache_bytes) for w in agent.info().workers] == [
        ("decode-b-1", "b", "decode", 3 * 2**30)
    ]
    assert not agent.cold


@pytest.mark.parametrize("agent", [(1, 60)], indirect=True)
def test_the_pool_is_refilled_once_the_new_worker_beats_not_while_it_starts(agent):
    eventually(lambda: agent.info().standbys == {"prefill": 1, "decode": 1})
    agent.activate(command("a", "decode", "decode-a-1"))
    agent.check()
    assert agent.standbys["decode"] == []  # its imports would slow the worker's start on these cores
    agent.joined("someone-else")
    assert agent.standbys["decode"] == []
    agent.joined("decode-a-1")  # its first heartbeat
    assert len(agent.standbys["decode"]) == 1


def test_a_drained_worker_that_exits_is_forgotten_and_a_dead_standby_replaced(agent):
    eventually(lambda: agent.info().standbys == {"prefill": 1, "decode": 1})
    standby = agent.standbys["prefill"][0]
    agent.activate(command("a", "prefill", "prefill-a-1"))
    standby.log_path.with_suffix(".stop").touch()  # it drained: exits with status 0
    eventually(lambda: not standby.alive())
    dying = agent.standbys["decode"][0]
    dying.kill()
    agent.check()
    assert agent.info().workers == [] and dying not in agent.standbys["decode"]
    assert len(agent.standbys["decode"]) == 1


@pytest.mark.parametrize("agent", [(0, 0)], indirect=True)
def test_without_a_ready_standby_the_worker_starts_cold(agent):
    outcome = agent.activate(command("a", "prefill", "prefill-a-2"))
    assert outcome.accepted and outcome.reason == "cold (no standby ready)"
    assert [(s, e["MESH_SERVED_MODEL_NAME"], name) for s, e, name in agent.cold] == [
        ("prefill-worker", "a", "prefill-a-2")
    ]


def test_refusals_say_why(agent):
    agent.activate(command("a", "decode", "decode-a-1", kv_cache_bytes=3 * 2**30))
    reasons = [
        agent.activate(command(model, "decode", worker_id, kv_cache_bytes=kv)).reason
        for model, worker_id, kv in (("nope", "x", 0), ("wide", "y", 0), ("a", "decode-a-1", 0), ("b", "z", 2**30 + 1))
    ]
    reasons.append(agent.activate(command("whole", "prefill", "w")).reason)
    assert reasons == [
        "'nope' is not in this host's catalogue (MESH_MODELS)",
        "wide needs 2 tensor-parallel ranks; standbys here have one",
        "decode-a-1 runs here already",
        f"{2**30 + 1} bytes of KV would exceed this host's budget ({4 * 2**30}, {3 * 2**30} given to its workers)",
        "whole is served by decode workers only, not prefill",
    ]


def eventually_read(path: Path) -> str:
    eventually(path.exists)
    return path.read_text()
