"""The placement service on a real nats-server and redis-server, with fake workers: only heartbeats
and the migrate/drain/role subjects, recording the commands they get."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from contextlib import asynccontextmanager

import pytest

from llmesh.deploy.launcher import start_redis, start_service
from llmesh.policies.core import kv_blocks
from llmesh.wire.bus import Bus
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import (
    Ack,
    ActivateCommand,
    ActivateOutcome,
    DrainCommand,
    HostedWorker,
    HostInfo,
    MigrateCommand,
    MigrateOutcome,
    ModelTraffic,
    PlacementDecision,
    PlacementRequest,
    PlacementStatus,
    RequestProgress,
    RoleCommand,
    RoleOutcome,
    Subjects,
    WorkerInfo,
)
from llmesh_placement.cli import main as cli_main
from llmesh_placement.service import PlacementService
from llmesh_placement.settings import PlacementSettings

pytestmark = pytest.mark.timeout(60)

BLOCK = 16


class FakeWorker:
    """Heartbeats every 0.2 s; answers migrations (accepting: the request leaves its list), drains and,
    built with both `roles`, role switches (accepting: it serves the new role at once)."""

    def __init__(
        self,
        bus: Bus,
        worker_id: str,
        requests: list[RequestProgress],
        role: str,
        accept: bool,
        roles: list[str],
        model: str = "m",
        host: str = "",
        memory_bytes: int = 0,
        weights_bytes: int = 0,
    ):
        self.bus, self.worker_id, self.requests, self.role, self.accept = bus, worker_id, requests, role, accept
        self.roles, self.model, self.host, self.memory_bytes = roles, model, host, memory_bytes
        self.weights_bytes = weights_bytes
        self.state = "active"
        self.migrations: list[tuple[float, MigrateCommand]] = []
        self.drains: list[DrainCommand] = []
        self.role_commands: list[RoleCommand] = []
        self._beating: asyncio.Task | None = None

    @classmethod
    async def start(
        cls, nats_url: str, worker_id: str, requests=(), role="decode", accept=True, roles=(), **where
    ) -> FakeWorker:
        """`requests`: (id, prompt tokens, generated, priority) of each."""
        bus = await Bus.connect(nats_url, worker_id)
        worker = cls(
            bus,
            worker_id,
            [
                RequestProgress(request_id=r, prompt_tokens=p, generated=g, max_tokens=512, priority=prio)
                for r, p, g, prio in requests
            ],
            role,
            accept,
            list(roles),
            **where,
        )
        await bus.serve(Subjects.migrate(worker_id), worker._on_migrate)
        await bus.serve(Subjects.drain(worker_id), worker._on_drain)
        if roles:
            await bus.serve(Subjects.role(worker_id), worker._on_role)
        await bus.publish(Subjects.HEARTBEAT, worker.info())
        worker._beating = asyncio.create_task(worker._beat())
        return worker

    def info(self) -> WorkerInfo:
        used = sum(kv_blocks(r.prompt_tokens + r.generated, BLOCK) for r in self.requests)
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            model=self.model,
            fingerprint="f" * 32,
            max_model_len=4096,
            running=len(self.requests),
            queued_tokens=0,
            capacity=8,
            heartbeat_s=0.2,
            state=self.state,
            kv_blocks_used=used,
            kv_blocks_total=100,
            block_size=BLOCK,
            requests=self.requests,
            roles=self.roles,
            host=self.host,
            memory_bytes=self.memory_bytes,
            weights_bytes=self.weights_bytes,
        )

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            await self.bus.publish(Subjects.HEARTBEAT, self.info())

    async def _on_migrate(self, cmd: MigrateCommand, blob) -> MigrateOutcome:
        self.migrations.append((time.monotonic(), cmd))
        if self.accept:
            self.requests = [r for r in self.requests if r.request_id != cmd.request_id]
        return MigrateOutcome(
            migration_id=cmd.migration_id,
            request_id=cmd.request_id,
            source=self.worker_id,
            target=cmd.target,
            accepted=self.accept,
            reason="" if self.accept else "fake refuses",
        )

    async def _on_drain(self, cmd: DrainCommand, blob) -> Ack:
        self.drains.append(cmd)
        self.state = "draining"
        await self.bus.publish(Subjects.HEARTBEAT, self.info())
        return Ack()

    async def _on_role(self, cmd: RoleCommand, blob) -> RoleOutcome:
        self.role_commands.append(cmd)
        self.role = cmd.role
        return RoleOutcome(command_id=cmd.command_id, worker_id=self.worker_id, role=cmd.role, accepted=True)

    def moved(self) -> list[tuple[str, str, str]]:
        """(request, target, reason) of each command, in order."""
        return [(c.request_id, c.target, c.reason) for _, c in self.migrations]

    async def close(self) -> None:
        self._beating.cancel()
        await self.bus.close()


@asynccontextmanager
async def fakes(nats_url, *specs):
    workers = [await FakeWorker.start(nats_url, *args, **kw) for args, kw in specs]
    try:
        yield workers
    finally:
        for worker in workers:
            await worker.close()


class Replica:
    """A placement service in this process, stopped by `shut` (idempotent)."""

    def __init__(self, bus: Bus, service: PlacementService):
        self.bus, self.service = bus, service
        self._stop = asyncio.Event()
        self._running = asyncio.create_task(service.run(self._stop))

    async def shut(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            await asyncio.wait_for(self._running, 5)
            await self.service.close()
            await self.bus.close()


@asynccontextmanager
async def placement(nats_url, placement_id, redis_url="", **settings):
    bus = await Bus.connect(nats_url, placement_id)
    service = await PlacementService.create(
        bus,
        PlacementSettings(nats_url=nats_url, redis_url=redis_url, placement_id=placement_id, **settings),
        placement_id,
    )
    replica = Replica(bus, service)
    try:
        yield replica
    finally:
        await replica.shut()


async def until(predicate, timeout, step=0.02):
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, f"not within {timeout}s"
        await asyncio.sleep(step)


async def recorded_events(bus) -> list[PlacementDecision]:
    """The decisions published from now on, as they come."""
    events = []

    async def on_event(decision, blob):
        events.append(decision)

    await bus.serve(Subjects.PLACEMENT_EVENTS, on_event)
    return events


async def ask(bus, **request) -> PlacementStatus:
    status, _ = await bus.request(Subjects.PLACEMENT, PlacementRequest(**request), PlacementStatus, timeout=5)
    return status


# ---- (a) one leader --------------------------------------------------------------------------------------------


async def test_exactly_one_leader_and_the_standby_takes_over(nats_url, redis_url):
    async with placement(nats_url, "lead-a", redis_url) as a, placement(nats_url, "lead-b", redis_url) as b:
        await until(lambda: a.service.leading or b.service.leading, 2)
        first, second = (a, b) if a.service.leading else (b, a)
        for _ in range(20):  # over about three renewals
            assert (first.service.leading, second.service.leading) == (True, False)
            await asyncio.sleep(0.05)
        client = await Bus.connect(nats_url, "lead-client")
        try:
            assert (await ask(client, op="status")).leader == first.service.placement_id
        finally:
            await client.close()
        stopped = time.monotonic()
        await first.shut()  # gives the lease up: the other leads at its next try
        await until(lambda: second.service.leading, second.service.settings.placement_lease_s / 3 + 0.5)
        print(f"takeover after a clean stop: {time.monotonic() - stopped:.2f}s")


async def test_a_leader_that_loses_redis_stops_leading(nats_url):
    redis, url = start_redis()
    try:
        async with placement(nats_url, "lonely", url, placement_lease_s=1.0) as replica:
            await until(lambda: replica.service.leading, 2)
            redis.kill()
            lost = time.monotonic()
            await until(lambda: not replica.service.leading, 1.0)  # before its lease could pass to anyone else
            print(f"stood down {time.monotonic() - lost:.2f}s after Redis died")
    finally:
        redis.stop()


async def test_a_leader_starved_for_a_moment_takes_its_lease_back_and_answers_what_came_meanwhile(nats_url):
    """Redis paused past a renewal's socket timeout (as a CPU-starved replica sees it): the leader stands
    by, takes its own key back at its next try once Redis answers, and a command sent while it stood by
    is answered, not dropped."""
    redis, url = start_redis()
    client = await Bus.connect(nats_url, "starved-client")
    try:
        async with placement(nats_url, "starved", url) as replica:
            await until(lambda: replica.service.leading, 2)
            redis.proc.send_signal(signal.SIGSTOP)
            try:
                await until(lambda: not replica.service.leading, 2)
                asked = asyncio.ensure_future(ask(client, op="status"))
                await asyncio.sleep(0.2)
            finally:
                redis.proc.send_signal(signal.SIGCONT)
            assert (await asked).leader == replica.service.placement_id
    finally:
        await client.close()
        redis.stop()


async def test_a_period_run_late_forgets_no_worker_or_host_whose_heartbeats_wait_unread(nats_url):
    """Placement starved of CPU for 5 s (in CI once: it forgot a model's workers, then activated the model
    again on the host agent): the heartbeats that came meanwhile are unread, not missed."""
    now = [0.0]
    bus = await Bus.connect(nats_url, "late-placement")
    try:
        service = PlacementService(bus, PlacementSettings(nats_url=nats_url), "late", clock=lambda: now[0])
        worker = FakeWorker(bus, "late-w", [], "decode", True, [], host="h")
        await service._on_heartbeat(worker.info(), memoryview(b""))  # heartbeat_s 0.2
        await service._on_host(HostInfo(host_id="h", memory_bytes=2**30, heartbeat_s=0.2), memoryview(b""))
        now[0] = 5.0
        service.step(late_s=4.8)  # due at 0.2
        status = service.status()
        assert [w.worker_id for w in status.workers] == ["late-w"] and [h.host_id for h in status.hosts] == ["h"]
        now[0] = 5.7
        service.step()
        status = service.status()
        assert status.workers == [] and status.hosts == []  # silent 0.7 s of placement's own time
    finally:
        await bus.close()


async def test_without_redis_a_replica_leads_alone(nats_url):
    async with placement(nats_url, "alone") as replica:
        assert replica.service.leading


async def test_a_killed_leader_is_replaced_and_commands_resume_within_3s(nats_url, redis_url, tmp_path):
    """Real processes: the leader is SIGKILLed (no lease given up); the standby takes over when the
    lease runs out and issues the next drain command."""
    async with fakes(nats_url, (("kill-src", [("k1", 100, 5, 0)]), {"accept": False}), (("kill-dst",), {})) as (
        src,
        dst,
    ):
        src.state = "draining"  # its request is moved (and refused) every period
        env = {"MESH_NATS_URL": nats_url, "MESH_REDIS_URL": redis_url}
        children = {
            pid: start_service("placement", env | {"MESH_PLACEMENT_ID": pid}, tmp_path / f"{pid}.log")
            for pid in ("proc-a", "proc-b")
        }
        client = await Bus.connect(nats_url, "kill-client")
        try:
            await until(lambda: src.migrations, 15, step=0.1)
            leader = (await ask(client, op="status")).leader
            standby = next(pid for pid in children if pid != leader)
            children[leader].kill()
            killed = time.monotonic()
            await until(lambda: src.migrations[-1][0] > killed + 0.1, 3.5)
            resumed = src.migrations[-1][0] - killed
            assert resumed < 3.0, f"commands resumed {resumed:.2f}s after the leader died"
            assert (await ask(client, op="status")).leader == standby
            assert all(reason == "drain" and target == "kill-dst" for _, target, reason in src.moved())
            print(f"commands resumed {resumed:.2f}s after the leader was killed")
        finally:
            await client.close()
            for child in children.values():
                child.stop()


# ---- (b) load balancing -------------------------------------------------------------------------------------------


async def test_skewed_load_moves_the_cheapest_request_to_the_freest_worker_once_per_cooldown(nats_url):
    # busy: 76 + 7 + 2 of 100 blocks for 3 requests, freeness 5; idle: 100; mid: 74
    busy_requests = [("big", 1200, 1, 0), ("small", 100, 10, 0), ("urgent", 20, 1, -1)]
    async with fakes(
        nats_url,
        (("bal-busy", busy_requests), {"accept": False}),
        (("bal-idle",), {}),
        (("bal-mid", [("m", 400, 1, 0)]), {}),
    ) as (busy, idle, mid):
        watcher = await Bus.connect(nats_url, "bal-events")
        events = await recorded_events(watcher)
        try:
            async with placement(nats_url, "bal", placement_cooldown_s=3.0) as replica:
                await until(lambda: busy.migrations, 3)
                first_at = busy.migrations[0][0]
                await asyncio.sleep(1.6)
        finally:
            await watcher.close()
        moved = busy.moved()
        assert moved[0] == ("small", "bal-idle", "balance")  # least urgent, then fewest tokens
        assert [m[0] for m in moved].count("small") == 1  # refused, and not asked again within the cooldown
        assert moved[1][0] == "big"  # the next candidate; the urgent one last
        assert busy.migrations[1][0] - first_at >= 0.4  # one in flight per source, one per period
        assert not idle.migrations and not mid.migrations
        assert replica.service.decisions["migrate/refused"] == len(moved)
        assert any(
            isinstance(e, PlacementDecision)
            and e.kind == "migrate"
            and e.reason == "balance"
            and e.detail["request_id"] == "small"
            and e.detail["outcome"] == "refused"
            for e in events
        )


# ---- (c) drain -----------------------------------------------------------------------------------------------------


async def test_drain_moves_every_request_away_and_manual_migration(nats_url):
    async with fakes(
        nats_url,
        (("dr-src", [("r1", 50, 2, 0), ("r2", 60, 1, 0), ("r3", 40, 9, 1)]), {}),
        (("dr-dst", [("m1", 30, 3, 0)]), {}),
        (("dr-pre", [("p1", 30, 0, 0)]), {"role": "prefill"}),
    ) as (src, dst, pre):
        client = await Bus.connect(nats_url, "dr-client")
        try:
            async with placement(nats_url, "dr") as replica:
                await until(lambda: len(replica.service.status().workers) == 3, 2)
                with pytest.raises(InvalidRequest, match="no live worker 'nope'"):
                    await ask(client, op="drain", worker_id="nope")
                with pytest.raises(InvalidRequest, match="no decode worker reports request 'nope'"):
                    await ask(client, op="migrate", request_id="nope")
                with pytest.raises(InvalidRequest, match="prefill worker dr-pre"):
                    await ask(client, op="migrate", request_id="p1")
                with pytest.raises(InvalidRequest, match="target dr-dst already holds"):
                    await ask(client, op="migrate", request_id="m1", target="dr-dst")

                status = await ask(client, op="migrate", request_id="m1")  # default target: the only other
                assert status.message == "m1: dr-dst -> dr-src: accepted"
                assert dst.moved() == [("m1", "dr-src", "manual")]

                status = await ask(client, op="drain", worker_id="dr-src")
                assert src.drains == [DrainCommand(exit=True)]
                assert "its 3 requests move" in status.message
                assert next(w for w in status.workers if w.worker_id == "dr-src").state == "draining"
                await until(lambda: len(src.migrations) == 3, 2)
                await asyncio.sleep(0.6)  # a period more: nothing is sent twice
                assert sorted(src.moved()) == [
                    ("r1", "dr-dst", "drain"),
                    ("r2", "dr-dst", "drain"),
                    ("r3", "dr-dst", "drain"),
                ]
                status = await ask(client, op="status")
                assert (status.decisions["migrate/accepted"], status.decisions["drain/ok"]) == (4, 1)
                assert "migrate/refused" not in status.decisions and "migrate/error" not in status.decisions
        finally:
            await client.close()


# ---- (d) role switching ---------------------------------------------------------------------------------------------


async def test_busy_prefill_pool_gets_a_switchable_decode_worker_and_manual_role_commands(nats_url, capsys):
    prompts = [(f"p{i}", 200, 0, 0) for i in range(8)]  # a full prefill worker: U = 8/8 + 104/100
    async with fakes(
        nats_url,
        (("ro-p1", prompts), {"role": "prefill"}),
        (("ro-p2", [(f"q{i}", 200, 0, 0) for i in range(8)]), {"role": "prefill"}),
        (("ro-d1", [("r1", 50, 4, 0)]), {"roles": ("prefill", "decode")}),
        (("ro-d2",), {"roles": ("prefill", "decode")}),
        (("ro-d3",), {}),
    ) as (p1, p2, d1, d2, d3):
        client = await Bus.connect(nats_url, "ro-client")
        events = await recorded_events(client)
        try:
            async with placement(nats_url, "ro", placement_role_hold_s=0.3, placement_role_cooldown_s=30.0):
                await until(lambda: d2.role_commands, 3)  # the least loaded switchable decode worker
                cmd = d2.role_commands[0]
                assert (cmd.role, cmd.reason) == ("prefill", "banaserve")
                await until(lambda: any(e.kind == "role" for e in events), 1)
                decision = next(e for e in events if e.kind == "role")
                assert decision.reason == "banaserve" and decision.detail["outcome"] == "accepted"
                assert (decision.detail["worker_id"], decision.detail["from"], decision.detail["role"]) == (
                    "ro-d2",
                    "decode",
                    "prefill",
                )
                assert decision.detail["ratio"] >= 1.0 and decision.detail["prefill_load"] > 2.0

                with pytest.raises(InvalidRequest, match="ro-d3 is not built with both roles"):
                    await ask(client, op="role", worker_id="ro-d3", role="prefill")
                assert (
                    await ask(client, op="role", worker_id="ro-d2", role="prefill")
                ).message == "ro-d2 already serves prefill"
                status = await ask(client, op="role", worker_id="ro-d1", role="prefill")
                assert status.message == "ro-d1: decode -> prefill: accepted"
                assert [c.reason for c in d1.role_commands] == ["manual"]
                assert status.decisions["role/accepted"] == 2
                # the CLI in a thread (the service runs on this loop)
                rc_role = await asyncio.to_thread(cli_main, ["--nats", nats_url, "role", "ro-d2", "decode"])
                switched = capsys.readouterr().out
                rc_workers = await asyncio.to_thread(cli_main, ["--nats", nats_url, "workers"])
                await asyncio.sleep(0.6)  # within the cooldown: no more switches
                assert (len(d1.role_commands), len(d2.role_commands)) == (1, 2)
        finally:
            await client.close()
        assert not p1.role_commands and not p2.role_commands and not d3.role_commands
        workers = capsys.readouterr().out
        print(switched, workers, sep="\n")
        assert rc_role == 0 and switched == "ro-d2: prefill -> decode: accepted\n"
        rows = {line.split()[0]: line.split()[1] for line in workers.splitlines() if line.startswith("ro-")}
        assert rc_workers == 0 and rows == {
            "ro-p1": "prefill",
            "ro-p2": "prefill",
            "ro-d1": "prefill*",
            "ro-d2": "decode*",
            "ro-d3": "decode",
        }
        assert "* built with both roles" in workers


async def test_a_worker_switched_to_prefill_hands_its_decodes_to_the_decode_pool(nats_url):
    # sw serves prefill now: its decodes (r1, r2) move to the decode worker; its prompt (p1) stays
    async with fakes(
        nats_url,
        (
            ("sw-w", [("r1", 50, 4, 0), ("r2", 70, 1, 0), ("p1", 80, 0, 0)]),
            {"role": "prefill", "roles": ("prefill", "decode")},
        ),
        (("sw-d", [("m1", 30, 3, 0)]), {}),
        (("sw-p", [("q1", 30, 0, 0)]), {"role": "prefill"}),
    ) as (switched, decode, prefill):
        client = await Bus.connect(nats_url, "sw-client")
        events = await recorded_events(client)
        try:
            async with placement(nats_url, "sw", placement_balance=False):
                await until(lambda: len(switched.migrations) == 2, 3)
                await asyncio.sleep(0.6)  # a period more: nothing else moves
                status = await ask(client, op="status")
        finally:
            await client.close()
    assert sorted(switched.moved()) == [("r1", "sw-d", "role"), ("r2", "sw-d", "role")]
    assert not decode.migrations and not prefill.migrations
    assert status.decisions["migrate/accepted"] == 2
    assert sorted(e.detail["request_id"] for e in events if e.kind == "migrate" and e.reason == "role") == ["r1", "r2"]


async def test_the_devices_policy_moves_kv_and_switches_roles_by_algorithm_4_1(nats_url):
    # model "kv": d1 holds 4 requests of 20 KV blocks (U = 4/8 + 80/100), d2 none: two moves even them out;
    # model "roles": p1's prompts (U = 8/8 + 104/100) take half of d3, the decode pool keeping d4
    async with fakes(
        nats_url,
        (("mo-d1", [(r, 319, 1, 0) for r in "abcd"]), {"model": "kv"}),
        (("mo-d2",), {"model": "kv"}),
        (("mo-p1", [(f"q{i}", 200, 0, 0) for i in range(8)]), {"role": "prefill", "model": "roles"}),
        (("mo-d3",), {"roles": ("prefill", "decode"), "model": "roles"}),
        (("mo-d4", [("r1", 50, 4, 0)]), {"model": "roles"}),
    ) as (d1, d2, p1, d3, d4):
        client = await Bus.connect(nats_url, "mo-client")
        events = await recorded_events(client)
        try:
            async with placement(
                nats_url, "mo", placement_role_policy="devices", placement_balance=False, placement_modules_block_s=0.01
            ):
                await until(lambda: len(d1.migrations) >= 2 and d3.role_commands, 3)
                await until(lambda: any(e.kind == "role" for e in events), 1)
        finally:
            await client.close()
    assert d1.moved()[:2] == [("a", "mo-d2", "banaserve"), ("b", "mo-d2", "banaserve")]
    assert (d3.role_commands[0].role, d3.role_commands[0].reason) == ("prefill", "banaserve")
    decision = next(e for e in events if e.kind == "role")
    assert (decision.detail["source"], decision.detail["cost_s"]) == (
        "mo-p1",
        1.0,
    ) and "request_id" not in decision.detail
    assert decision.detail["benefit"] == pytest.approx(1.02)
    assert not p1.migrations and not d4.role_commands and not d2.migrations


# ---- (e) the CLI -----------------------------------------------------------------------------------------------------


async def cli(nats_url, *args):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "llmesh_placement.cli",
        "--nats",
        nats_url,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


async def test_cli_prints_workers_and_requests(nats_url, capsys):
    async with fakes(nats_url, (("cli-a", [("q1", 300, 4, 0), ("q2", 20, 1, 2)]), {}), (("cli-b",), {})):
        async with placement(nats_url, "cli-leader", placement_balance=False):
            await asyncio.sleep(0.3)
            (rc_w, workers, _), (rc_r, requests, _) = await asyncio.gather(
                cli(nats_url, "workers"), cli(nats_url, "requests")
            )
            # the errors in this process (a thread: the service runs on this loop), to spare a start-up
            rc_unknown = await asyncio.to_thread(cli_main, ["--nats", nats_url, "migrate", "nope"])
            unknown = capsys.readouterr().err
        rc_gone = await asyncio.to_thread(cli_main, ["--nats", nats_url, "--timeout", "1", "workers"])
        gone = capsys.readouterr().err
    print(workers, requests, sep="\n")
    assert rc_w == 0 and "leader cli-leader" in workers
    assert "scaling advice: a decode instance can go (-1)" in workers  # freeness 39.5 and 100: above 60 on average
    header, a, b = [line.split() for line in workers.splitlines()[:3]]
    assert header[:3] == ["WORKER", "ROLE", "STATE"]
    assert a[:5] == ["cli-a", "decode", "active", "2/8", "21/100"] and b[0] == "cli-b"
    assert rc_r == 0 and [line.split()[:2] for line in requests.splitlines()[1:]] == [["q1", "cli-a"], ["q2", "cli-a"]]
    assert rc_unknown == 1 and "no decode worker reports request 'nope'" in unknown
    assert rc_gone == 1 and "no placement service is running" in gone


# ---- (e) models on hosts (Prism) ---------------------------------------------------------------------------------

GIB = 2**30


class FakeHost:
    """A host agent: heartbeats `HostInfo`, and answers activations by starting a FakeWorker of the model
    on itself (what the real agent's standby becomes)."""

    def __init__(self, bus: Bus, nats_url: str, host_id: str, memory_bytes: int, worker_bytes: int):
        self.bus, self.nats_url, self.host_id = bus, nats_url, host_id
        self.memory_bytes, self.worker_bytes = memory_bytes, worker_bytes
        self.commands: list[ActivateCommand] = []
        self.workers: list[FakeWorker] = []
        self.crash_first = False
        self._beating: asyncio.Task | None = None

    @classmethod
    async def start(cls, nats_url, host_id, memory_bytes, worker_bytes=GIB) -> FakeHost:
        bus = await Bus.connect(nats_url, host_id)
        host = cls(bus, nats_url, host_id, memory_bytes, worker_bytes)
        await bus.serve(Subjects.activate(host_id), host._on_activate)
        host._beating = asyncio.create_task(host._beat())
        return host

    async def _beat(self) -> None:
        while True:
            info = HostInfo(
                host_id=self.host_id,
                heartbeat_s=0.2,
                standbys={"prefill": 1, "decode": 1},
                memory_bytes=self.memory_bytes,
                workers=[HostedWorker(worker_id=w.worker_id, model=w.model, role=w.role) for w in self.workers],
            )
            await self.bus.publish(Subjects.HOST_HEARTBEAT, info)
            await asyncio.sleep(0.2)

    async def _on_activate(self, cmd: ActivateCommand, blob) -> ActivateOutcome:
        self.commands.append(cmd)
        if self.crash_first and len(self.commands) == 1:  # took it, and the worker died starting
            return ActivateOutcome(
                command_id=cmd.command_id, host_id=self.host_id, worker_id=cmd.worker_id, accepted=True, reason="test"
            )
        self.workers.append(
            await FakeWorker.start(
                self.nats_url,
                cmd.worker_id,
                role=cmd.role,
                model=cmd.model,
                host=self.host_id,
                memory_bytes=self.worker_bytes,
            )
        )
        return ActivateOutcome(
            command_id=cmd.command_id, host_id=self.host_id, worker_id=cmd.worker_id, accepted=True, reason="test"
        )

    async def close(self) -> None:
        self._beating.cancel()
        for worker in self.workers:
            await worker.close()
        await self.bus.close()


async def publish_traffic(bus: Bus, traffic: dict, step: dict[str, int] | None = None) -> None:
    """A router's `ModelTraffic` every 0.2 s from what `traffic` holds then (arrivals, parked), `step` more
    arrivals of each model each time."""
    arrivals = traffic["arrivals"]
    while True:
        await bus.publish(Subjects.TRAFFIC, ModelTraffic(router_id="r", **traffic))
        for model, n in (step or {}).items():
            arrivals[model] = arrivals.get(model, 0) + n
        await asyncio.sleep(0.2)


CATALOGUE = [{"name": "a"}, {"name": "b", "ttft_slo_ms": 500}]


@pytest.mark.parametrize("aggregated", [False, True])
async def test_a_model_requests_wait_for_is_activated_on_a_host_once_per_role(nats_url, capsys, aggregated):
    """b served aggregated: one engine, a decode worker (running whole requests), gets all b's KV."""
    catalogue = [CATALOGUE[0], {**CATALOGUE[1], "disaggregated": not aggregated}]
    roles = [("b", "decode")] if aggregated else [("b", "decode"), ("b", "prefill")]
    host = await FakeHost.start(nats_url, "h1", memory_bytes=10 * GIB)
    client = await Bus.connect(nats_url, "models-client")
    traffic = {"arrivals": {"a": 5, "b": 2}, "parked": {}}
    sending = asyncio.create_task(publish_traffic(client, traffic, step={"a": 2, "b": 1}))
    try:
        async with (
            fakes(
                nats_url,
                (
                    ("a-p",),
                    {"role": "prefill", "model": "a", "host": "h1", "memory_bytes": GIB, "weights_bytes": GIB // 4},
                ),
                (("a-d",), {"model": "a", "host": "h1", "memory_bytes": GIB, "weights_bytes": GIB // 4}),
            ),
            placement(nats_url, "models-1", models=catalogue, placement_period_s=0.1) as replica,
        ):
            events = await recorded_events(client)
            await until(lambda: replica.service.models.models({})[0].rate > 0, 5)  # a's rate is measured
            traffic["parked"] = {"b": 2}  # then b's requests wait
            await until(lambda: len(host.workers) == len(roles), 5)
            traffic["parked"] = {}  # the router placed them on the new workers
            await asyncio.sleep(1.0)  # more periods: no second activation
            assert sorted((c.model, c.role) for c in host.commands) == roles
            # the KV space: h1's 10 GiB less a's two engines (2 GiB) and the weights of b's engines (as a's,
            # 1/4 GiB each), all b's (the one model to start there), in equal parts for its engines
            kv = 31 * GIB // 4 if aggregated else 15 * GIB // 4
            assert [c.kv_cache_bytes for c in host.commands] == [kv] * len(roles)
            status = await ask(client, op="status")
            rc = await asyncio.to_thread(cli_main, ["--nats", nats_url, "models"])
    finally:
        sending.cancel()
        await host.close()
        await client.close()
    assert replica.service.decisions["activate/accepted"] == len(roles)
    activations = [e for e in events if e.kind == "activate"]
    assert len(activations) == len(roles)
    assert all(e.detail["host"] == "h1" and e.detail["parked"] == 2 for e in activations)
    # b joins a's host: its weight (rate / SLO) is added to a's over the memory both leave for KV
    assert all(0 < e.detail["kvpr_before"] < e.detail["kvpr_after"] for e in activations)
    assert [m.name for m in status.models] == ["a", "b"] and status.models[1].hosts == ["h1"]
    out = capsys.readouterr().out
    print(out)
    assert rc == 0 and "activate b decode on h1" in out and f"KV {kv / GIB:.2f} GiB" in out and "KVPR" in out


async def test_a_model_that_fits_nowhere_evicts_the_idle_one_then_is_activated(nats_url):
    """h1 holds a (two workers of 1 GiB) in 2.5 GiB; b, as large as a, fits only once a, idle, is drained."""
    host = await FakeHost.start(nats_url, "h1", memory_bytes=5 * GIB // 2)
    client = await Bus.connect(nats_url, "evict-client")
    traffic = {"arrivals": {"a": 3}, "parked": {"b": 1}}
    sending = asyncio.create_task(publish_traffic(client, traffic))
    try:
        async with (
            fakes(
                nats_url,
                (("ev-a-p",), {"role": "prefill", "model": "a", "host": "h1", "memory_bytes": GIB}),
                (("ev-a-d",), {"model": "a", "host": "h1", "memory_bytes": GIB}),
            ) as a_workers,
            placement(nats_url, "models-2", models=CATALOGUE, placement_period_s=0.1, placement_idle_s=0) as replica,
        ):
            events = await recorded_events(client)
            await until(lambda: all(w.drains for w in a_workers), 5)
            await asyncio.sleep(0.6)  # periods with a's workers draining: they hold their memory until they exit
            assert not host.commands  # so b waits until a is gone
            for worker in a_workers:  # drained and empty: they exit
                await worker.close()
            await until(lambda: len(host.workers) == 2, 5)
            status = await ask(client, op="status")
    finally:
        sending.cancel()
        await host.close()
        await client.close()
    evictions = [e for e in events if e.kind == "evict"]
    assert sorted(e.detail["worker_id"] for e in evictions) == ["ev-a-d", "ev-a-p"]
    assert all(e.detail["for"] == "b" and e.detail["kvpr_after"] == 0 for e in evictions)
    assert replica.service.decisions["evict/ok"] == 2 and replica.service.decisions["activate/accepted"] == 2
    assert [e.kind for e in status.events] == ["evict", "evict", "activate", "activate"]
    # b's two engines share what h1 has then: at most all of it (a's second worker may still be leaving)
    kv = [c.kv_cache_bytes for c in host.commands]
    assert kv[0] == kv[1] and 0 < kv[0] <= 5 * GIB // 4


async def test_a_model_not_seen_yet_counts_one_engine_a_role_so_an_aggregated_one_fits_beside_an_idle_one(nats_url):
    """h1 holds a (two workers of 1 GiB) in 3.5 GiB; b, served aggregated and never seen, counts as one
    engine like a's (1 GiB): it fits beside a, idle as it is, and a is not evicted for it (it was when a
    model not seen counted as the others' whole footprint: in CI once, the mesh's own model)."""
    host = await FakeHost.start(nats_url, "h1", memory_bytes=7 * GIB // 2)
    client = await Bus.connect(nats_url, "fits-client")
    traffic = {"arrivals": {"a": 3}, "parked": {"b": 1}}
    sending = asyncio.create_task(publish_traffic(client, traffic))
    catalogue = [CATALOGUE[0], {**CATALOGUE[1], "disaggregated": False}]
    try:
        async with (
            fakes(
                nats_url,
                (("fit-a-p",), {"role": "prefill", "model": "a", "host": "h1", "memory_bytes": GIB}),
                (("fit-a-d",), {"model": "a", "host": "h1", "memory_bytes": GIB}),
            ) as a_workers,
            placement(nats_url, "models-fit", models=catalogue, placement_period_s=0.1, placement_idle_s=0),
        ):
            events = await recorded_events(client)
            await until(lambda: host.workers, 5)
            await asyncio.sleep(0.5)  # more periods: nothing else
    finally:
        sending.cancel()
        await host.close()
        await client.close()
    assert [(c.model, c.role) for c in host.commands] == [("b", "decode")]
    assert [e.kind for e in events if e.kind in ("activate", "evict")] == ["activate"]
    assert not any(w.drains for w in a_workers)


async def test_autoscaling_starts_a_decode_worker_through_the_host_agent_and_drains_the_idlest(nats_url):
    """Llumnix's autoscaling: a's decode worker is nearly out of KV (freeness 3 < 10) for the window, so a
    second one is activated on its host; later, both empty (freeness 100 > 60) for the window, the one with
    the fewest requests is drained, down to the minimum of one."""
    host = await FakeHost.start(nats_url, "h1", memory_bytes=10 * GIB)
    client = await Bus.connect(nats_url, "scale-client")
    full = [(f"s{i}", 470, 10, 0) for i in range(3)]  # 30 blocks of 100 each
    try:
        async with (
            fakes(
                nats_url,
                (("sc-p",), {"role": "prefill", "model": "a", "host": "h1"}),
                (
                    ("sc-d",),
                    {"requests": full, "model": "a", "host": "h1", "memory_bytes": GIB, "weights_bytes": GIB // 4},
                ),
            ) as (_, busy),
            placement(
                nats_url,
                "scaler",
                models=CATALOGUE,
                placement_period_s=0.1,
                placement_autoscale=True,
                placement_scale_window_s=0.5,
                placement_scale_down_window_s=0.5,
                placement_balance=False,
            ) as replica,
        ):
            events = await recorded_events(client)
            await until(lambda: len(host.workers) == 1, 5)
            started = host.workers[0]
            assert (started.model, started.role, host.commands[0].reason) == ("a", "decode", "scale-up")
            assert host.commands[0].kv_cache_bytes == 3 * GIB // 4  # as much KV as the worker it relieves
            busy.requests = busy.requests[:1]  # load falls: both nearly empty
            await until(lambda: started.drains or busy.drains, 5)
            await asyncio.sleep(1.0)  # more windows: at the minimum, nothing more
            assert len(started.drains) + len(busy.drains) == 1 and started.drains  # the one with fewer requests
            assert len(host.commands) == 1
    finally:
        await host.close()
        await client.close()
    scaled = [e for e in events if e.kind in ("activate", "drain")]
    assert [(e.kind, e.reason) for e in scaled] == [("activate", "scale-up"), ("drain", "scale-down")]
    assert scaled[0].detail["mean_freeness"] < 10 < 60 < scaled[1].detail["mean_freeness"]
    assert replica.service.decisions["drain/ok"] == 1


async def test_algorithm_1_moves_a_model_to_the_host_of_lower_pressure_activating_it_there_first(nats_url):
    """a and b both run on h1, h2 is empty: Algorithm 1 keeps b (the heavier: rate over a tighter SLO) on h1
    and moves a to h2. a is activated on h2; once its workers there beat, its workers on h1 are drained."""
    hosts = [await FakeHost.start(nats_url, h, memory_bytes=10 * GIB) for h in ("h1", "h2")]
    client = await Bus.connect(nats_url, "move-client")
    traffic = {"arrivals": {"a": 0, "b": 0}, "parked": {}}
    sending = asyncio.create_task(publish_traffic(client, traffic, step={"a": 1, "b": 1}))
    on_h1 = {"host": "h1", "memory_bytes": GIB}
    try:
        async with (
            fakes(
                nats_url,
                *(
                    ((f"mv-{m}-{r}",), {"role": r, "model": m, **on_h1})
                    for m in ("a", "b")
                    for r in ("prefill", "decode")
                ),
            ) as old,
            placement(nats_url, "mover", models=CATALOGUE, placement_period_s=0.1) as replica,
        ):
            events = await recorded_events(client)
            await until(lambda: any(w.drains for w in old), 10)
            await asyncio.sleep(0.5)
    finally:
        sending.cancel()
        for host in hosts:
            await host.close()
        await client.close()
    assert not hosts[0].commands and sorted((c.model, c.role, c.reason) for c in hosts[1].commands) == [
        ("a", "decode", "move"),
        ("a", "prefill", "move"),
    ]
    assert sorted(w.worker_id for w in old if w.drains) == ["mv-a-decode", "mv-a-prefill"]
    moves = [e for e in events if e.reason == "move"]
    assert [e.kind for e in moves] == ["activate", "activate", "drain", "drain"]
    first = moves[0].detail
    assert first["from"] == "h1" and first["kvpr_after"] < first["source_kvpr_before"]
    assert replica.service.decisions["drain/ok"] == 2


async def test_an_activated_worker_that_dies_before_joining_is_asked_for_again(nats_url):
    host = await FakeHost.start(nats_url, "h1", memory_bytes=10 * GIB)
    host.crash_first = True
    client = await Bus.connect(nats_url, "lost-client")
    sending = asyncio.create_task(publish_traffic(client, {"arrivals": {"b": 1}, "parked": {"b": 1}}))
    try:
        async with placement(nats_url, "lost", models=CATALOGUE, placement_period_s=0.1):
            await until(lambda: len(host.workers) == 2, 5)
    finally:
        sending.cancel()
        await host.close()
        await client.close()
    first, *again = host.commands
    assert len(again) == 2 and (first.model, first.role) in {(c.model, c.role) for c in again}
    assert first.worker_id not in {c.worker_id for c in again}
