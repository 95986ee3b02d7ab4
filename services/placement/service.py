"""The placement loop and the operator's commands.

Every replica tracks the workers' heartbeats; only the lease holder (`lease.py`) acts. Each period
the leader, over the decode workers:
- empties the draining ones, and hands the decodes of a worker switched to prefill to the decode
  pool: each request goes to the freest active decode worker with room (one command per request
  at a time; a refused one is tried again the next period);
- balances load as Llumnix does: `migration_pairs` matches the least free workers with the
  freest, and `pick_migration` chooses what moves; a request moved (or refused) is left alone
  for `placement_cooldown_s`, and a worker party to a move takes no other until the move is done
  and it has sent a heartbeat since;
- publishes its scaling advice (Llumnix's freeness band) when it changes;
and, over the prefill and decode workers of each model and KV layout, switches a worker built with
both roles to the pool that needs it (BanaServe's adaptive module migration, `pick_role_switch`:
the pools' mean utilisations must have parted by more than a threshold for a while, not soon after
the last switch, and the imbalance removed must outweigh the switch's cost), one at a time.
Commands run as tasks, so one slow hand-shake does not hold the loop; each is traced, counted
(`decisions`, Prometheus) and published as a `PlacementDecision`. Operator requests on
`Subjects.PLACEMENT` are answered by the leader alone; unknown workers, requests or targets are
`InvalidRequest` errors.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from itertools import groupby
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as PromCounter

from llmesh.policies import WorkerView
from llmesh.policies.banaserve import (
    ModuleMigrationParams,
    RoleBalance,
    RoleSwitchParams,
    pick_role_switch,
    plan_module_migrations,
    switchable,
)
from llmesh.policies.core import Role
from llmesh.policies.llumnix import (
    ScaleHold,
    freeness,
    freeness_with_one_fewer,
    migration_pairs,
    pick_migration,
    scale_decision,
    scaling_advice,
)
from llmesh.policies.views import worker_view
from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.errors import InvalidRequest, MeshError, ServiceUnavailable
from llmesh.wire.messages import (
    Ack,
    DrainCommand,
    HostInfo,
    Message,
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

from .lease import LeaderLease
from .models import ModelPlacer
from .settings import PlacementSettings

log = logging.getLogger(__name__)

MISSED_HEARTBEATS = 3  # a worker silent this many periods is forgotten
DRAIN_TIMEOUT_S = 5.0
FORGET_MOVES_S = 30.0  # past the cooldown, how long a finished move is remembered
SCALING = {1: "up", -1: "down", 0: "hold"}


def by_layout(views: Iterable[WorkerView]) -> Iterator[tuple[tuple[str, str], list[WorkerView]]]:
    """`views` grouped by model and KV layout (the workers that can stand in for one another), in id order."""
    ordered = sorted(views, key=lambda v: (v.model, v.fingerprint, v.worker_id))
    for layout, group in groupby(ordered, key=lambda v: (v.model, v.fingerprint)):
        yield layout, list(group)


@dataclass
class _Worker:
    info: WorkerInfo
    seen_at: float  # when its last heartbeat came (the service's clock)
    late_s: float = 0.0  # how late the service's periods ran since: credited against expiry only


@dataclass
class _Move:
    """A MigrateCommand this replica issued."""

    command: MigrateCommand
    source: str
    issued_at: float
    task: asyncio.Task[tuple[str, str]] | None = None  # -> (outcome, the source's reason)
    done_at: float | None = None
    accepted: bool = False

    @property
    def in_flight(self) -> bool:
        return self.done_at is None


class PlacementService:
    def __init__(
        self, bus: Bus, settings: PlacementSettings, placement_id: str, clock: Callable[[], float] = time.monotonic
    ):
        self.placement_id = placement_id
        self.settings = settings
        self.decisions: Counter[str] = Counter()  # "<kind>/<outcome>" -> commands and advice since start
        self.scaling = 0
        self.registry = CollectorRegistry()
        self._decision_counter = PromCounter(
            "llmesh_placement_decisions",
            "Commands and scaling advice issued, by kind and outcome",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self._leader_gauge = Gauge(
            "llmesh_placement_leader", "1 while this replica holds the leader lease", registry=self.registry
        )
        self._scaling_gauge = Gauge(
            "llmesh_placement_scaling",
            "Scaling advice: +1 add a decode instance, -1 one can go, 0 hold",
            registry=self.registry,
        )
        self._bus = bus
        self._clock = clock
        self._lease = LeaderLease(settings.redis_url, placement_id, settings.placement_lease_s, self._on_lease, clock)
        self._leader_gauge.set(self._lease.held)
        self._tracer = telemetry.tracer("llmesh.placement")
        self._workers: dict[str, _Worker] = {}
        self._draining: set[str] = set()  # drained by command (until their heartbeats say so too)
        self._moves: dict[str, _Move] = {}  # by request id: the last command for it
        self._role_params = RoleSwitchParams(
            threshold=settings.placement_role_threshold,
            hold_s=settings.placement_role_hold_s,
            cooldown_s=settings.placement_role_cooldown_s,
            min_ratio=settings.placement_role_min_ratio,
            switch_cost=settings.placement_role_switch_cost,
            request_cost=settings.placement_role_request_cost,
            backlog_s=settings.placement_role_backlog_s,
        )
        self._role_balance: dict[tuple[str, str], RoleBalance] = {}  # by model and KV layout
        self._module_params = ModuleMigrationParams(
            start_gap=settings.placement_modules_start_gap,
            stop_gap=settings.placement_modules_stop_gap,
            min_ratio=settings.placement_modules_min_ratio,
            block_s=settings.placement_modules_block_s,
            sync_s=settings.placement_modules_sync_s,
            switch_s=settings.placement_modules_switch_s,
            budget_s=settings.placement_modules_budget_s,
            backlog_s=settings.placement_role_backlog_s,
        )
        self._modules_migrating: dict[tuple[str, str], bool] = {}  # by model and KV layout: Algorithm 4-1's state
        self._switching: set[str] = set()  # workers with a role command in flight
        self._scale_holds: dict[str, ScaleHold] = {}  # by model: autoscaling's advice over time
        self._tasks: set[asyncio.Task] = set()
        self._wake = asyncio.Event()  # run a period now
        self.models = ModelPlacer(
            bus,
            settings,
            clock,
            self._announce,
            self._count,
            self._spawn,
            lambda info, kind, reason, detail: self._drain_worker(info, kind, reason, detail),
        )

    @classmethod
    async def create(
        cls, bus: Bus, settings: PlacementSettings, placement_id: str, clock: Callable[[], float] = time.monotonic
    ) -> PlacementService:
        service = cls(bus, settings, placement_id, clock)
        await bus.serve(Subjects.HEARTBEAT, service._on_heartbeat, traced=False)
        await bus.serve(Subjects.HOST_HEARTBEAT, service._on_host, traced=False)
        await bus.serve(Subjects.TRAFFIC, service._on_traffic, traced=False)
        await bus.serve(Subjects.PLACEMENT, service._on_command, span="placement command")
        return service

    @property
    def leading(self) -> bool:
        return self._lease.held

    async def run(self, stop: asyncio.Event) -> None:
        """Hold or wait for the lease, and place each period while leading, until `stop` is set."""
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(self._lease.run()), group.create_task(self._periods())]
            await stop.wait()
            for task in tasks:
                task.cancel()

    async def close(self) -> None:
        """Cancel the commands in flight and give the lease up (once `run` has returned)."""
        for task in [*self._tasks, *(m.task for m in self._moves.values() if m.task is not None)]:
            task.cancel()
        await self._lease.close()

    def _on_lease(self, held: bool) -> None:
        self._leader_gauge.set(held)
        if held:
            self._wake.set()  # act at once: the heartbeats are already known

    async def _periods(self) -> None:
        while True:
            due = self._clock() + self.settings.placement_period_s
            try:
                await asyncio.wait_for(self._wake.wait(), self.settings.placement_period_s)
            except TimeoutError:
                pass
            self._wake.clear()
            self.step(late_s=max(self._clock() - due, 0.0))

    # ---- the loop ------------------------------------------------------------------------------------------

    async def _on_heartbeat(self, info: Message, blob: memoryview) -> None:
        if isinstance(info, WorkerInfo):
            if info.worker_id not in self._workers:
                log.info("worker %s (%s) joined", info.worker_id, info.role)
            self._workers[info.worker_id] = _Worker(info, self._clock())

    async def _on_host(self, info: Message, blob: memoryview) -> None:
        if isinstance(info, HostInfo):
            self.models.on_host(info)

    async def _on_traffic(self, traffic: Message, blob: memoryview) -> None:
        if isinstance(traffic, ModelTraffic):
            self.models.on_traffic(traffic)

    def step(self, late_s: float = 0.0) -> None:
        """One period: forget silent workers and old moves; as leader, move the decodes off draining
        and switched workers, balance the others, advise on scaling and switch a worker's role if the
        pools need it. `late_s`: how late this period runs (`_expire`)."""
        self._expire(late_s)
        if not self._lease.held:
            return
        views = self._views()
        decode = self._decode_views(views)
        self._evacuate(views)
        if self.settings.placement_balance:
            self._balance(decode)
        self._advise(decode)
        if self.settings.placement_roles:
            self._switch_roles(views)
        if self.settings.placement_models:
            self.models.step(self._infos())
        if self.settings.placement_autoscale:
            self._autoscale(decode)

    def _expire(self, late_s: float) -> None:
        """Forget the workers, hosts and routers silent for MISSED_HEARTBEATS periods. `late_s`: how late
        this check runs (this process was starved of CPU or blocked): that long is credited to each, since
        the heartbeats that came meanwhile are still unread, not missed (as the router's registry does)."""
        self.models.expire(MISSED_HEARTBEATS, late_s)
        now = self._clock()
        for worker_id, worker in list(self._workers.items()):
            worker.late_s += late_s
            if now - worker.seen_at - worker.late_s > MISSED_HEARTBEATS * worker.info.heartbeat_s:
                log.warning("worker %s missed %d heartbeats: forgotten", worker_id, MISSED_HEARTBEATS)
                del self._workers[worker_id]
                self._draining.discard(worker_id)
        forget_after = self.settings.placement_cooldown_s + FORGET_MOVES_S
        for request_id, move in list(self._moves.items()):
            if move.done_at is not None and now - move.done_at > forget_after:
                del self._moves[request_id]

    def _views(self) -> dict[str, WorkerView]:
        """The live workers as the policies see them: drained ones as draining, and the moves on
        their way to each (not in its heartbeat yet) counted as assigned."""
        pending = Counter(m.command.target for m in self._moves.values() if self._unsettled(m, m.command.target))
        views = {}
        for worker_id, worker in self._workers.items():
            view = replace(worker_view(worker.info), assigned=pending[worker_id])
            views[worker_id] = replace(view, state="draining") if worker_id in self._draining else view
        return views

    def _decode_views(self, views: dict[str, WorkerView] | None = None) -> dict[str, WorkerView]:
        """The decode workers of `views` (default: `_views()`)."""
        views = self._views() if views is None else views
        return {worker_id: v for worker_id, v in views.items() if v.role == "decode"}

    def _seen_at(self, worker_id: str) -> float:
        worker = self._workers.get(worker_id)
        return worker.seen_at if worker is not None else float("-inf")

    def _unsettled(self, move: _Move, worker_id: str) -> bool:
        """`move` is in flight, or was accepted after `worker_id`'s last heartbeat (which then
        does not show it yet)."""
        return move.done_at is None or (move.accepted and self._seen_at(worker_id) <= move.done_at)

    def _movable(self, request: RequestProgress, holder: str, cooldown_s: float) -> bool:
        """The loop may move `request` off `holder` now."""
        if request.migrating or request.prefilling:
            return False
        move = self._moves.get(request.request_id)
        return move is None or (not self._unsettled(move, holder) and self._clock() - move.issued_at >= cooldown_s)

    def _destination(self, views: dict[str, WorkerView], source: WorkerView) -> WorkerView | None:
        """The freest (as `migration_pairs` reckons) active decode worker with room that can take `source`'s
        requests (model, KV layout)."""
        headroom = self.settings.placement_priority_headroom_blocks
        fits = [
            v
            for v in views.values()
            if v.worker_id != source.worker_id
            and v.role == "decode"
            and v.state == "active"
            and v.has_room
            and (v.model, v.fingerprint) == (source.model, source.fingerprint)
        ]
        return min(fits, key=lambda v: (-freeness(v, headroom, head_of_line=True), v.worker_id), default=None)

    def _evacuate(self, views: dict[str, WorkerView]) -> None:
        """Move every decode off the workers that should hold none to the freest destination: the
        draining decode workers, and those built with both roles that serve prefill now (BanaServe's
        module migration: the decodes leave with the role, so the prefills it now takes do not stall them)."""
        for source in sorted(views.values(), key=lambda v: v.worker_id):
            reason = (
                "drain"
                if source.role == "decode" and source.state == "draining"
                else "role"
                if source.role == "prefill" and "decode" in source.roles
                else None
            )
            if reason is None:
                continue
            for request in source.requests:
                if not self._movable(request, source.worker_id, cooldown_s=0.0):
                    continue  # a prompt (its own prefill) or a request already moving
                destination = self._destination(views, source)
                if destination is None:
                    break  # nowhere to go now: the next period tries again
                self._start(request, views[source.worker_id], destination, reason, views)

    def _moving(self) -> set[str]:
        """The workers a move involves (in flight, or not in their heartbeats yet)."""
        return {w for m in self._moves.values() for w in (m.source, m.command.target) if self._unsettled(m, w)}

    def _balance(self, views: dict[str, WorkerView]) -> None:
        """Llumnix's load balancing, per model and KV layout, among the workers no move involves."""
        moving = self._moving()
        settled = (v for v in views.values() if v.state == "active" and v.worker_id not in moving)
        s = self.settings
        for _, group in by_layout(settled):
            for source, destination in migration_pairs(
                group, s.placement_source_below, s.placement_destination_above, s.placement_priority_headroom_blocks
            ):
                if not destination.has_room:
                    continue
                movable = tuple(
                    r for r in source.requests if self._movable(r, source.worker_id, s.placement_cooldown_s)
                )
                request = pick_migration(replace(source, requests=movable))
                if request is not None:
                    self._start(request, source, destination, "balance", views)

    def _advise(self, views: dict[str, WorkerView]) -> None:
        s = self.settings
        advice = scaling_advice(
            list(views.values()), s.placement_scale_low, s.placement_scale_high, s.placement_priority_headroom_blocks
        )
        if advice == self.scaling:
            return
        self.scaling = advice
        self._scaling_gauge.set(advice)
        self._count("scale", SCALING[advice])
        reason = {1: "add a decode instance", -1: "a decode instance can go", 0: "hold"}[advice]
        log.info("scaling advice: %s", reason)
        self._spawn(
            self._announce(
                PlacementDecision(
                    kind="scale",
                    reason=reason,
                    detail={"advice": advice, "decode_workers": sum(v.state == "active" for v in views.values())},
                )
            )
        )

    def _autoscale(self, views: dict[str, WorkerView]) -> None:
        """Llumnix's autoscaling per model: start a decode worker through a host agent, or drain the one with
        the fewest requests, on the mean freeness of its active decode workers over a window (`scale_decision`)."""
        if not self.models.hosts():
            return  # no host agent to start workers: advice only
        s, now = self.settings, self._clock()
        for model in sorted({v.model for v in views.values()}):
            group = [v for v in views.values() if v.model == model and v.state == "active" and v.kv_blocks_total]
            settling = self.models.activating(model, "decode") or any(
                v.model == model and v.state == "draining" for v in views.values()
            )
            headroom = s.placement_priority_headroom_blocks
            mean = sum(freeness(v, headroom) for v in group) / len(group) if group else None
            victim = min(group, key=lambda v: (len(v.requests), v.worker_id), default=None)
            fewer = freeness_with_one_fewer(group, victim, headroom) if victim is not None else 0.0
            action, self._scale_holds[model], window_mean = scale_decision(
                None if settling else mean,
                fewer,
                len(group),
                now,
                self._scale_holds.get(model, ScaleHold()),
                s.placement_scale_window_s,
                s.placement_scale_down_window_s,
                s.placement_scale_low,
                s.placement_scale_high,
                s.placement_min_decode_workers,
                s.placement_max_decode_workers,
            )
            reckoning = {
                "decode_workers": len(group),
                "mean_freeness": None if mean is None else round(mean, 1),
                "window_mean_freeness": None if window_mean is None else round(window_mean, 1),
                "freeness_with_one_fewer": round(fewer, 1),
            }
            if action > 0 and not self.models.activating(model, "decode"):
                infos = self._infos()
                host = self.models.host_for(model, "decode", infos)
                if host is not None:
                    kv = self.models.replica_kv(model, "decode", infos)
                    self.models.activate(model, "decode", host, "scale-up", reckoning, kv)
            elif action < 0 and victim is not None:
                self._spawn(self._drain_worker(self._workers[victim.worker_id].info, "drain", "scale-down", reckoning))

    def _switch_roles(self, views: dict[str, WorkerView]) -> None:
        """BanaServe's role switching per model and KV layout, while no role command is in flight."""
        if self._switching:
            return
        if self.settings.placement_role_policy == "devices":
            self._migrate_modules(views)
            return
        now = self._clock()
        for layout, group in by_layout(views.values()):
            switch, self._role_balance[layout] = pick_role_switch(
                group, now, self._role_balance.get(layout, RoleBalance()), self._role_params
            )
            if switch is not None:
                self._start_role(views[switch.worker_id], switch.role, "banaserve", asdict(switch))

    def _migrate_modules(self, views: dict[str, WorkerView]) -> None:
        """BanaServe's Algorithm 4-1 per model and KV layout, among the workers no move involves: its role
        switches, and its KV moves except those of a request moved within the cooldown or to a worker
        switching now (the next period plans again)."""
        moving = self._moving()
        cooldown = self.settings.placement_cooldown_s
        for layout, group in by_layout(v for v in views.values() if v.worker_id not in moving):
            moves, self._modules_migrating[layout] = plan_module_migrations(
                group, self._modules_migrating.get(layout, False), self._module_params
            )
            for m in moves:
                if m.request_id is None:
                    reckoning = {k: v for k, v in asdict(m).items() if k != "request_id"}  # none: no span attribute
                    self._start_role(views[m.destination], m.role, "banaserve", reckoning)
                    continue
                request = next(r for r in views[m.source].requests if r.request_id == m.request_id)
                if m.destination not in self._switching and self._movable(request, m.source, cooldown):
                    self._start(request, views[m.source], views[m.destination], "banaserve", views)

    # ---- commands ------------------------------------------------------------------------------------------

    def _start(
        self,
        request: RequestProgress,
        source: WorkerView,
        target: WorkerView,
        reason: str,
        views: dict[str, WorkerView] | None = None,
    ) -> _Move:
        """Send a MigrateCommand in its own task; count the request on `target` in `views` meanwhile."""
        command = MigrateCommand(
            migration_id=uuid.uuid4().hex, request_id=request.request_id, target=target.worker_id, reason=reason
        )
        move = _Move(command, source.worker_id, self._clock())
        self._moves[request.request_id] = move
        move.task = asyncio.create_task(self._migrate(move))
        if views is not None:
            views[target.worker_id] = replace(
                target, requests=(*target.requests, request), assigned=target.assigned + 1
            )
            views[source.worker_id] = replace(source, requests=tuple(r for r in source.requests if r is not request))
        return move

    async def _migrate(self, move: _Move) -> tuple[str, str]:
        """Run one MigrateCommand: its outcome ("accepted", "refused" or "error") and the reason given."""
        cmd = move.command
        attributes = {
            "migration.id": cmd.migration_id,
            "request.id": cmd.request_id,
            "migration.source": move.source,
            "migration.target": cmd.target,
            "migration.reason": cmd.reason,
        }
        with self._tracer.start_as_current_span(
            "placement.migrate", kind=trace.SpanKind.CLIENT, attributes=attributes
        ) as span:
            try:
                outcome, _ = await self._bus.request(
                    Subjects.migrate(move.source),
                    cmd,
                    MigrateOutcome,
                    timeout=self.settings.placement_migrate_timeout_s,
                )
                result, reason = ("accepted" if outcome.accepted else "refused"), outcome.reason
            except MeshError as exc:
                result, reason = "error", exc.message
                span.set_status(trace.StatusCode.ERROR, reason)
            span.set_attributes({"migration.outcome": result, "migration.refusal": reason})
        move.done_at, move.accepted = self._clock(), result == "accepted"
        self._count("migrate", result)
        log.info(
            "migrate %s %s -> %s (%s): %s%s",
            cmd.request_id,
            move.source,
            cmd.target,
            cmd.reason,
            result,
            f": {reason}" if reason else "",
        )
        await self._announce(
            PlacementDecision(
                kind="migrate",
                reason=cmd.reason,
                detail={
                    "migration_id": cmd.migration_id,
                    "request_id": cmd.request_id,
                    "source": move.source,
                    "target": cmd.target,
                    "outcome": result,
                    "refusal": reason,
                },
            )
        )
        return result, reason

    def _start_role(
        self, worker: WorkerView, role: Role, reason: str, reckoning: dict[str, Any] | None = None
    ) -> asyncio.Task[tuple[str, str]]:
        """Send `worker` a RoleCommand in its own task (the policy's numbers in `reckoning`)."""
        self._switching.add(worker.worker_id)
        return self._spawn(
            self._switch_role(
                worker, RoleCommand(command_id=uuid.uuid4().hex, role=role, reason=reason), reckoning or {}
            )
        )

    async def _switch_role(self, worker: WorkerView, cmd: RoleCommand, reckoning: dict[str, Any]) -> tuple[str, str]:
        """Run one RoleCommand: its outcome ("accepted", "refused" or "error") and the worker's reason."""
        detail = {
            "command_id": cmd.command_id,
            "worker_id": worker.worker_id,
            "from": worker.role,
            "role": cmd.role,
            **reckoning,
        }
        try:
            with self._tracer.start_as_current_span(
                "placement.role",
                kind=trace.SpanKind.CLIENT,
                attributes={
                    "worker.id": worker.worker_id,
                    "role.reason": cmd.reason,
                    **{f"role.{k}": v for k, v in detail.items() if k != "worker_id"},
                },
            ) as span:
                try:
                    outcome, _ = await self._bus.request(
                        Subjects.role(worker.worker_id),
                        cmd,
                        RoleOutcome,
                        timeout=self.settings.placement_role_timeout_s,
                    )
                    result, refusal = ("accepted" if outcome.accepted else "refused"), outcome.reason
                    self._believe_role(worker.worker_id, outcome.role)
                except MeshError as exc:
                    result, refusal = "error", exc.message
                    span.set_status(trace.StatusCode.ERROR, refusal)
                span.set_attributes({"role.outcome": result, "role.refusal": refusal})
        finally:
            self._switching.discard(worker.worker_id)
        self._count("role", result)
        log.info(
            "role %s %s -> %s (%s): %s%s",
            worker.worker_id,
            worker.role,
            cmd.role,
            cmd.reason,
            result,
            f": {refusal}" if refusal else "",
        )
        await self._announce(
            PlacementDecision(kind="role", reason=cmd.reason, detail={**detail, "outcome": result, "refusal": refusal})
        )
        return result, refusal

    def _believe_role(self, worker_id: str, role: Role) -> None:
        """Take the role a worker says it serves as known until its next heartbeat shows it."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.info.role != role:
            worker.info = worker.info.model_copy(update={"role": role})

    def _count(self, kind: str, outcome: str) -> None:
        self.decisions[f"{kind}/{outcome}"] += 1
        self._decision_counter.labels(kind, outcome).inc()

    async def _announce(self, decision: PlacementDecision) -> None:
        try:
            await self._bus.publish(Subjects.PLACEMENT_EVENTS, decision)
        except Exception as exc:  # best effort: the decision is counted and logged anyway
            log.warning("could not publish %s decision: %s", decision.kind, exc)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- operator commands -----------------------------------------------------------------------------------

    async def _on_command(self, cmd: Message, blob: memoryview) -> PlacementStatus | None:
        if not await self._leading_within(self.settings.placement_lease_s):
            return None  # the leader answers
        if not isinstance(cmd, PlacementRequest):
            raise InvalidRequest(f"expected PlacementRequest, got {type(cmd).__name__}")
        message = ""
        if cmd.op == "drain":
            message = await self.drain(cmd.worker_id)
        elif cmd.op == "migrate":
            message = await self.migrate(cmd.request_id, cmd.target)
        elif cmd.op == "role":
            message = await self.switch_role(cmd.worker_id, cmd.role)
        return self.status(message)

    async def _leading_within(self, wait_s: float) -> bool:
        """Whether this replica leads, waiting up to `wait_s` for a lease it lost for a moment (a
        renewal that timed out) to come back, so that an operator's command is not dropped meanwhile."""
        give_up = time.monotonic() + wait_s
        while not self._lease.held:
            if time.monotonic() >= give_up:
                return False
            await asyncio.sleep(0.05)
        return True

    def _infos(self) -> dict[str, WorkerInfo]:
        """The live workers' heartbeats, those drained by command shown draining."""
        return {
            worker_id: w.info.model_copy(update={"state": "draining"}) if worker_id in self._draining else w.info
            for worker_id, w in sorted(self._workers.items())
        }

    def status(self, message: str = "") -> PlacementStatus:
        infos = self._infos()
        return PlacementStatus(
            leader=self.placement_id,
            workers=list(infos.values()),
            decisions=dict(self.decisions),
            scaling=self.scaling,
            message=message,
            hosts=self.models.hosts(),
            models=self.models.models(infos),
            events=list(self.models.events),
        )

    async def drain(self, worker_id: str | None) -> str:
        """Tell `worker_id` to take nothing new and exit once empty; the loop then moves a decode
        worker's requests away (a prefill worker finishes its own)."""
        info = self._live(worker_id).info
        error = await self._drain_worker(info, "drain", "manual")
        if error is not None:
            raise type(error)(f"{info.worker_id} did not take the drain: {error.message}")
        if info.role == "prefill":
            return f"{info.worker_id} drains: it finishes its {len(info.requests)} requests, then exits"
        if self._destination(self._decode_views(), worker_view(info)) is None:
            return (
                f"{info.worker_id} drains, but no other active decode worker has room: its "
                f"{len(info.requests)} requests stay until one has"
            )
        return f"{info.worker_id} drains: its {len(info.requests)} requests move to other decode workers, then it exits"

    async def _drain_worker(
        self, info: WorkerInfo, kind: str, reason: str, detail: dict[str, Any] | None = None
    ) -> MeshError | None:
        """Drain `info` (it exits once empty) and record the decision (`kind`: drain or evict); the error if it
        did not take the drain."""
        error = None
        with self._tracer.start_as_current_span(
            "placement.drain",
            kind=trace.SpanKind.CLIENT,
            attributes={"worker.id": info.worker_id, "drain.reason": reason},
        ) as span:
            try:
                await self._bus.request(
                    Subjects.drain(info.worker_id), DrainCommand(exit=True), Ack, timeout=DRAIN_TIMEOUT_S
                )
            except MeshError as exc:
                error = exc
                span.set_status(trace.StatusCode.ERROR, exc.message)
        if error is None:
            self._draining.add(info.worker_id)
            self._wake.set()
        log.info(
            "%s %s (%s, %s, %d requests): %s",
            *(kind, info.worker_id, info.role, reason, len(info.requests), error.message if error else "draining"),
        )
        await self.models.decide(
            kind,
            reason,
            {
                "worker_id": info.worker_id,
                "role": info.role,
                "model": info.model,
                "host": info.host,
                "requests": len(info.requests),
                **(detail or {}),
                "outcome": "ok" if error is None else "error",
                "refusal": error.message if error else "",
            },
        )
        return error

    def _live(self, worker_id: str | None) -> _Worker:
        worker = self._workers.get(worker_id or "")
        if worker is None:
            raise InvalidRequest(
                f"no live worker {worker_id!r}; live: {', '.join(sorted(self._workers)) or 'none'}", param="worker_id"
            )
        return worker

    async def switch_role(self, worker_id: str | None, role: Role | None) -> str:
        """Have `worker_id`, built with both roles, serve `role` now (the loop moves its decodes away
        when that is prefill); the worker's answer. The policy switches nothing for a cooldown after it."""
        self._live(worker_id)
        assert worker_id is not None  # live
        if role is None:
            raise InvalidRequest("say which role it should serve: prefill or decode", param="role")
        views = self._views()
        view = views[worker_id]
        if not switchable(view):
            raise InvalidRequest(
                f"{worker_id} is not built with both roles: it serves {view.role} only", param="worker_id"
            )
        if view.role == role:
            return f"{worker_id} already serves {role}"
        if worker_id in self._switching:
            return f"{worker_id} is already switching roles"
        if not any(
            v.worker_id != worker_id
            and v.state == "active"
            and (v.role, v.model, v.fingerprint) == (view.role, view.model, view.fingerprint)
            for v in views.values()
        ):
            raise InvalidRequest(
                f"{worker_id} is the last active {view.role} worker of its model and KV layout", param="worker_id"
            )
        self._role_balance[(view.model, view.fingerprint)] = RoleBalance(last_switch_at=self._clock())
        result, refusal = await asyncio.shield(self._start_role(view, role, "manual"))
        if result == "accepted":
            return f"{worker_id}: {view.role} -> {role}: accepted"
        return f"{worker_id} stays {view.role} ({result}): {refusal}"

    async def migrate(self, request_id: str | None, target: str | None) -> str:
        """Move `request_id` to `target` (default: the freest other active decode worker with room)
        now; the source's answer."""
        views = self._decode_views()
        source = next((v for v in views.values() if any(r.request_id == request_id for r in v.requests)), None)
        if source is None:
            elsewhere = next(
                (w for w in self._workers.values() if any(r.request_id == request_id for r in w.info.requests)), None
            )
            detail = f" (it is on {elsewhere.info.role} worker {elsewhere.info.worker_id})" if elsewhere else ""
            raise InvalidRequest(f"no decode worker reports request {request_id!r}{detail}", param="request_id")
        if target is None:
            destination = self._destination(views, source)
            if destination is None:
                raise ServiceUnavailable(f"no other active decode worker with room can take {request_id}")
        else:
            destination = views.get(target)
            problem = (
                "is not a live decode worker"
                if destination is None
                else "already holds the request"
                if destination is source
                else "is draining"
                if destination.state != "active"
                else "serves another model or KV layout"
                if (destination.model, destination.fingerprint) != (source.model, source.fingerprint)
                else ""
            )
            if problem:
                raise InvalidRequest(f"target {target} {problem}", param="target")
            assert destination is not None  # else a problem
        previous = self._moves.get(request_id or "")
        if previous is not None and previous.in_flight:
            return f"{request_id} is already moving to {previous.command.target}"
        request = next(r for r in source.requests if r.request_id == request_id)
        move = self._start(request, source, destination, "manual")
        assert move.task is not None  # started
        result, reason = await asyncio.shield(move.task)
        if result == "accepted":
            return f"{request_id}: {source.worker_id} -> {destination.worker_id}: accepted"
        return f"{request_id} stays on {source.worker_id} ({result}): {reason}"
