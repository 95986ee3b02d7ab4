"""Which models run on which hosts (Prism): activation of models that requests wait for, and idle eviction.

Inputs, all from the bus: the host agents' heartbeats (`HostInfo`: ready standbys, memory budget), the
routers' traffic (`ModelTraffic`: arrivals and parked requests by model) and the workers' heartbeats
(`WorkerInfo`: model, host, the memory their engines hold). Each period the leader runs Prism's
Algorithm 1 (`llmesh.policies.prism.place_models`) over the hosts, with each model's measured rate
over its TTFT target; then, for every model with parked requests and no active worker of a role, it
asks the host that Algorithm 1 picks to activate one (`ActivateCommand`; the agent turns a pre-started
process into the worker). A model that fits on no host makes room by Prism's idle eviction
(`idle_evictions`): the idle models on hosts short of memory, larger SLOs first, are drained (their
workers finish what they hold, live migration moves decodes away, then they exit). Every decision is a
`PlacementDecision` with its inputs, KV pressure before and after included, also kept for the CLI.

A model's footprint is what its workers' engines hold (weights and KV space, from their heartbeats): an
engine's KV space is fixed when it starts (vLLM's on CPU; on GPU too, short of sleep mode or elastic KV),
so placement chooses it at activation: the host's memory free now, less the weights of the engines still
to start there, is split among the models placed there that hold nothing yet by rate over SLO
(`kv_shares`), each model's share over its engines to start. A model not seen yet is counted at the
mean footprint of the models that were. A running model that
Algorithm 1 moves to another host (its pressure there lower by more than τ) is activated there first;
then its workers on the old host are drained.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from llmesh.policies.prism import Device, ModelDemand, idle_evictions, kv_pressure, kv_shares, place_models
from llmesh.wire.bus import Bus
from llmesh.wire.config import ROLES, model_roles, name_tag
from llmesh.wire.errors import MeshError
from llmesh.wire.messages import (
    ActivateCommand,
    ActivateOutcome,
    HostInfo,
    ModelPlacement,
    ModelTraffic,
    PlacementDecision,
    Subjects,
    WorkerInfo,
)

from .settings import PlacementSettings

log = logging.getLogger(__name__)

RATE_HALF_LIFE_S = 30.0  # of the smoothed request rates
EVENTS_KEPT = 50
ACTIVATE_TIMEOUT_S = 10.0
REFUSED_RETRY_S = 5.0  # an activation refused (or failed) is asked for again after this


@dataclass
class _Seen:
    info: Any
    at: float
    late_s: float = 0.0  # how late placement's periods ran since: credited against expiry only


@dataclass
class _Activation:
    host: str
    worker_id: str
    issued_at: float
    kv_cache_bytes: int = 0
    refused: bool = False
    accepted_at: float | None = None  # when its host agent took the command


def worker_name(role: str, model: str) -> str:
    return f"{role}-{name_tag(model)}-{uuid.uuid4().hex[:6]}"


class ModelPlacer:
    def __init__(
        self,
        bus: Bus,
        settings: PlacementSettings,
        clock: Callable[[], float],
        announce: Callable[[PlacementDecision], Coroutine[Any, Any, None]],
        count: Callable[[str, str], None],
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task],
        drain: Callable[[WorkerInfo, str, str, dict[str, Any]], Coroutine[Any, Any, Any]],
    ):
        """`drain(worker, kind, reason, detail)`: the service's drain, which records the decision."""
        self._bus, self.settings, self._clock = bus, settings, clock
        self._announce, self._count, self._spawn, self._drain = announce, count, spawn, drain
        self.catalogue = {m.name: m for m in settings.catalogue()}
        self._hosts: dict[str, _Seen] = {}
        self._room: dict[str, int] = {}  # host -> memory for models this period (see _inputs)
        self._traffic: dict[str, _Seen] = {}  # by router
        self._rates: dict[str, float] = defaultdict(float)  # model -> requests/s, smoothed, over the routers
        self._last_arrival: dict[str, float] = {}
        self._activations: dict[tuple[str, str], _Activation] = {}  # (model, role) -> the last one asked for
        self._evicting: dict[str, float] = {}  # model -> when its drain was asked for
        self._evicted: set[str] = set()  # evicted for idleness, not activated since: reserved no KV
        self._footprints: dict[str, int] = {}  # model -> bytes its workers held when last seen
        self._weights: dict[str, int] = {}  # model -> bytes of weights one of its engines holds
        self._engine_bytes: dict[str, int] = {}  # model -> bytes one of its engines holds (weights and KV)
        self._moves: dict[str, tuple[str, str, float]] = {}  # model -> (from host, to host, since)
        self._moved_at: dict[str, float] = {}
        self.events: deque[PlacementDecision] = deque(maxlen=EVENTS_KEPT)

    # ---- inputs ---------------------------------------------------------------------------------------------

    def on_host(self, info: HostInfo) -> None:
        if info.host_id not in self._hosts:
            log.info("host %s joined (%.1f GiB for models)", info.host_id, info.memory_bytes / 2**30)
        self._hosts[info.host_id] = _Seen(info, self._clock())

    def on_traffic(self, traffic: ModelTraffic) -> None:
        now = self._clock()
        before = self._traffic.get(traffic.router_id)
        self._traffic[traffic.router_id] = _Seen(traffic, now)
        if before is None:
            return
        dt = max(now - before.at, 1e-3)
        keep = 0.5 ** (dt / RATE_HALF_LIFE_S)
        for model in self.catalogue.keys() | traffic.arrivals.keys():
            new = traffic.arrivals.get(model, 0) - before.info.arrivals.get(model, 0)
            if new > 0:
                self._last_arrival[model] = now
            self._rates[model] = keep * self._rates[model] + (1 - keep) * max(new, 0) / dt

    def expire(self, missed: int, late_s: float = 0.0) -> None:
        """Forget the hosts and routers silent for `missed` periods, `late_s` credited (`Placement._expire`)."""
        now = self._clock()
        for seen in (self._hosts, self._traffic):
            for key, entry in list(seen.items()):
                entry.late_s += late_s
                period = entry.info.heartbeat_s if isinstance(entry.info, HostInfo) else 1.0
                if now - entry.at - entry.late_s > missed * period:
                    del seen[key]

    def parked(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for entry in self._traffic.values():
            for model, n in entry.info.parked.items():
                out[model] += n
        return out

    def idle_s(self, model: str) -> float:
        last = self._last_arrival.get(model)
        return math.inf if last is None else self._clock() - last

    # ---- the period ---------------------------------------------------------------------------------------

    def step(self, workers: dict[str, WorkerInfo]) -> None:
        """Activate what parked requests need where Algorithm 1 places it; evict idle models to make room."""
        if not self._hosts:
            return  # no host agent: the deployment's workers are all there is
        now = self._clock()
        active = [w for w in workers.values() if w.state == "active"]
        self._settle(workers, now)
        parked_now = self.parked()
        demands, devices, current = self._inputs(active, workers)
        wanted = [d for d in demands if d.name in current or parked_now.get(d.name, 0) > 0]  # not the others
        placed = place_models(wanted, devices, current, self.settings.placement_move_threshold / 2**30)
        by_name = {d.name: d for d in demands}
        for model, parked in sorted(parked_now.items()):
            if parked <= 0 or model not in self.catalogue:
                continue
            for role in self._roles(model):
                if any(w.model == model and w.role == role for w in active) or (model, role) in self._activations:
                    continue
                target = placed.get(model, (None,))[0]
                if target is None:
                    self._make_room(by_name[model], demands, devices, current, workers)
                    break
                detail = {
                    "parked": parked,
                    "rate": round(self._rates[model], 3),
                    "kvpr_before": self.pressure(target, demands, current),
                    "kvpr_after": self.pressure(target, demands, {**current, model: (target,)}),
                }
                self.activate(
                    model, role, target, "parked", detail, self.kv_share(model, target, placed, workers, demands)
                )
        self._move(placed, current, active, demands, workers, now)

    def _move(
        self,
        placed: dict[str, tuple[str, ...]],
        current: dict[str, tuple[str, ...]],
        active: list[WorkerInfo],
        demands: list[ModelDemand],
        workers: dict[str, WorkerInfo],
        now: float,
    ) -> None:
        """Algorithm 1's moves: a running model that it puts on another host (by more than τ) is activated
        there; once its workers there are active, those on the old host are drained (live migration moves
        their decodes). One move per model at a time, none within the cooldown of the last."""
        for model, (source, target, since) in list(self._moves.items()):
            if set(self._roles(model)) <= {w.role for w in active if w.model == model and w.host == target}:
                for w in active:
                    if w.model == model and w.host == source:
                        self._spawn(self._drain(w, "drain", "move", {"to": target}))
                del self._moves[model]
            elif now - since > self.settings.placement_activate_timeout_s:
                log.warning("moving %s from %s to %s took too long: stays on %s", model, source, target, source)
                del self._moves[model]
        for model, hosts in sorted(placed.items()):
            here = current.get(model)
            busy = model in self._moves or model in self._evicting or any(self.activating(model, r) for r in ROLES)
            cooled = now - self._moved_at.get(model, -math.inf) >= self.settings.placement_move_cooldown_s
            if not here or hosts[0] == here[0] or busy or not cooled:
                continue
            source, target = here[0], hosts[0]
            self._moves[model], self._moved_at[model] = (source, target, now), now
            after = {**current, model: (target,)}
            detail = {
                "from": source,
                "rate": round(self._rates[model], 3),
                "kvpr_before": self.pressure(target, demands, current),
                "kvpr_after": self.pressure(target, demands, after),
                "source_kvpr_before": self.pressure(source, demands, current),
                "source_kvpr_after": self.pressure(source, demands, after),
            }
            for role in self._roles(model):
                self.activate(
                    model, role, target, "move", detail, self.kv_share(model, target, placed, workers, demands)
                )

    def _settle(self, workers: dict[str, WorkerInfo], now: float) -> None:
        """Forget activations whose worker is heartbeating, failed or took too long; evictions done."""
        timeout = self.settings.placement_activate_timeout_s
        for key, act in list(self._activations.items()):
            retry = act.refused and now - act.issued_at > REFUSED_RETRY_S
            if self._lost(act):
                log.warning(
                    "worker %s (%s) exited before it joined: %s will start another", act.worker_id, key[0], act.host
                )
                retry = True
            if act.worker_id in workers or retry or now - act.issued_at > timeout:
                if act.worker_id not in workers and not act.refused:
                    log.warning("worker %s (%s) did not join within %.0f s", act.worker_id, key[0], timeout)
                del self._activations[key]
        for model, since in list(self._evicting.items()):
            if not any(w.model == model for w in workers.values()) or now - since > timeout:
                del self._evicting[model]
        for model in self.catalogue:
            held = sum(w.memory_bytes for w in workers.values() if w.model == model)
            hosts = {w.host for w in workers.values() if w.model == model}
            if held:
                self._footprints[model] = held // len(hosts)
            weights = [w.weights_bytes for w in workers.values() if w.model == model and w.weights_bytes]
            if weights:
                self._weights[model] = max(weights)
            engines = [w.memory_bytes for w in workers.values() if w.model == model and w.memory_bytes]
            if engines:
                self._engine_bytes[model] = max(engines)

    def _lost(self, act: _Activation) -> bool:
        """Its host agent took the command, and a heartbeat of the agent's since no longer lists the worker."""
        host = self._hosts.get(act.host)
        return (
            act.accepted_at is not None
            and host is not None
            and host.at > act.accepted_at + host.info.heartbeat_s
            and all(w.worker_id != act.worker_id for w in host.info.workers)
        )

    def _inputs(
        self, active: list[WorkerInfo], workers: dict[str, WorkerInfo]
    ) -> tuple[list[ModelDemand], list[Device], dict[str, tuple[str, ...]]]:
        """Algorithm 1's inputs: each model's rate, SLO and footprint (a model not seen yet: one engine a
        role, each the size of the others' engines); the hosts, each with its budget less what its leaving
        (draining, evicted) workers hold until they exit; where models run."""
        engine = statistics.mean(self._engine_bytes.values()) if self._engine_bytes else 0
        demands = [
            ModelDemand(
                name=name,
                rate=self._rates[name],
                slo_s=(entry.ttft_slo_ms or self.settings.placement_slo_ms) / 1000,
                weights_bytes=self._footprints.get(name, int(engine * len(self._roles(name)))),
            )
            for name, entry in self.catalogue.items()
        ]
        leaving: dict[str, int] = defaultdict(int)
        for w in workers.values():
            if w.state != "active":
                leaving[w.host] += w.memory_bytes
        self._room = {h: max(0, seen.info.memory_bytes - leaving[h]) for h, seen in self._hosts.items()}
        devices = [Device(h, room) for h, room in sorted(self._room.items())]
        current: dict[str, tuple[str, ...]] = {}
        for w in sorted(active, key=lambda w: w.worker_id):
            if w.host in self._hosts and w.host not in current.get(w.model, ()):
                current[w.model] = (*current.get(w.model, ()), w.host)
        for (model, _), act in self._activations.items():
            current.setdefault(model, (act.host,))
        return demands, devices, {m: hosts[:1] for m, hosts in current.items()}

    def pressure(self, host: str, demands: list[ModelDemand], current: dict[str, tuple[str, ...]]) -> float:
        """A host's KV pressure with the models `current` places on it, per GiB (requests/s per SLO second per
        GiB left for KV: `kv_pressure` is per byte)."""
        on = [d for d in demands if host in current.get(d.name, ())]
        memory = self._room.get(host, 0)
        return kv_pressure(sum(d.weight for d in on), memory - sum(d.weights_bytes for d in on)) * 2**30

    # ---- commands -----------------------------------------------------------------------------------------

    def activate(
        self, model: str, role: str, host: str, reason: str, detail: dict[str, Any], kv_cache_bytes: int = 0
    ) -> None:
        """Ask `host`'s agent for a worker of `model` in `role` with `kv_cache_bytes` of KV space (0: the
        worker's own setting), in its own task; `detail`: the inputs."""
        worker_id = worker_name(role, model)
        self._evicted.discard(model)
        self._activations[(model, role)] = _Activation(host, worker_id, self._clock(), kv_cache_bytes)
        cmd = ActivateCommand(
            command_id=uuid.uuid4().hex,
            model=model,
            role=role,
            worker_id=worker_id,
            reason=reason,
            kv_cache_bytes=kv_cache_bytes,
        )
        where = {"model": model, "role": role, "host": host, "worker_id": worker_id, "kv_cache_bytes": kv_cache_bytes}
        self._spawn(self._send_activate(cmd, {**where, **detail}))

    def kv_share(
        self,
        model: str,
        host: str,
        placed: dict[str, tuple[str, ...]],
        workers: dict[str, WorkerInfo],
        demands: list[ModelDemand],
    ) -> int:
        """KV space for one more engine of `model` on `host`. The memory there not held by running engines,
        less the weights of the engines starting or still to start, is split among the models they belong
        to by their weight in `demands` (`kv_shares`): those Algorithm 1 places there and those placed
        nowhere but not evicted for idleness (with fixed KV, what one takes the others cannot get back).
        `model`'s share, less what its starting engines were given, goes in equal parts to its engines
        still to start."""
        fallback = max(self._weights.values(), default=0)
        on_host = [w for w in workers.values() if w.host == host and w.state == "active"]  # `_room` has the rest
        running = {(w.model, w.role) for w in on_host}
        starting = {
            key: act.kv_cache_bytes
            for key, act in self._activations.items()
            if act.host == host and act.worker_id not in workers
        }
        elsewhere = {w.model for w in workers.values()} | {m for m, _ in self._activations}
        may_come = self.catalogue.keys() - elsewhere - self._evicted  # placed nowhere: it may come here
        lacking = {
            (m, r)
            for m in {model, *may_come, *(m for m, hosts in placed.items() if host in hosts)}
            for r in self._roles(m)
            if (m, r) not in running and (m, r) not in starting
        }
        pending = lacking | set(starting)
        free = (
            self._room.get(host, 0)
            - sum(w.memory_bytes for w in on_host)
            - sum(self._weights.get(m, fallback) for m, _ in pending)
        )
        weight = {d.name: d.weight for d in demands}
        shares = kv_shares({m: weight[m] for m, _ in pending}, free)
        given = sum(kv for (m, _), kv in starting.items() if m == model)
        to_start = sum(1 for m, _ in lacking if m == model)
        return max(shares[model] - given, 0) // max(to_start, 1)

    def replica_kv(self, model: str, role: str, workers: dict[str, WorkerInfo]) -> int:
        """KV space for another engine like those of `model` in `role` (a scale-up): theirs, the largest
        (0: none reports it; the worker's own setting)."""
        kv = [w.memory_bytes - w.weights_bytes for w in workers.values() if w.model == model and w.role == role]
        return max((k for k in kv if k > 0), default=0)

    def _roles(self, model: str) -> tuple[str, ...]:
        return model_roles(self.catalogue, model)

    def activating(self, model: str, role: str) -> bool:
        return (model, role) in self._activations

    def host_for(self, model: str, role: str, workers: dict[str, WorkerInfo]) -> str | None:
        """Where another worker of `model` in `role` goes: a host its workers run on with a ready standby of
        the role, else any host with one, else any host (it starts cold there)."""
        hosts = [seen.info for _, seen in sorted(self._hosts.items())]
        own = {w.host for w in workers.values() if w.model == model}
        ready = [h for h in hosts if h.standbys.get(role, 0) > 0]
        choice = next((h for h in ready if h.host_id in own), None) or next(iter(ready), None)
        return choice.host_id if choice else (hosts[0].host_id if hosts else None)

    async def _send_activate(self, cmd: ActivateCommand, detail: dict[str, Any]) -> None:
        try:
            outcome, _ = await self._bus.request(
                Subjects.activate(detail["host"]), cmd, ActivateOutcome, timeout=ACTIVATE_TIMEOUT_S
            )
            result, reason = ("accepted" if outcome.accepted else "refused"), outcome.reason
        except MeshError as exc:
            result, reason = "error", exc.message
        act = self._activations.get((cmd.model, cmd.role))
        if act is not None and act.worker_id == cmd.worker_id:
            if result == "accepted":
                act.accepted_at = self._clock()
            else:
                act.refused = True  # asked again after REFUSED_RETRY_S
        log.info(
            "activate %s (%s) on %s as %s (%s): %s: %s",
            *(cmd.model, cmd.role, detail["host"], cmd.worker_id, cmd.reason, result, reason),
        )
        await self.decide("activate", cmd.reason, {**detail, "outcome": result, "how": reason})

    def _make_room(
        self,
        model: ModelDemand,
        demands: list[ModelDemand],
        devices: list[Device],
        current: dict[str, tuple[str, ...]],
        workers: dict[str, WorkerInfo],
    ) -> None:
        """Prism's idle eviction: drain the idle models that free the memory `model` lacks."""
        used: dict[str, int] = defaultdict(int)
        for d in demands:
            for host in current.get(d.name, ()):
                used[host] += d.weights_bytes
        short = {dev.device_id: model.weights_bytes - (dev.memory_bytes - used[dev.device_id]) + 1 for dev in devices}
        idle = {d.name: self.idle_s(d.name) for d in demands}
        placed_now = {m: h for m, h in current.items() if m != model.name and m not in self._evicting}
        for victim in idle_evictions(demands, placed_now, idle, short, self.settings.placement_idle_s):
            self._evicting[victim] = self._clock()
            self._evicted.add(victim)
            for w in workers.values():
                if w.model == victim and w.state == "active":
                    after = {m: h for m, h in current.items() if m != victim}
                    detail = {
                        "model": victim,
                        "for": model.name,
                        "idle_s": round(idle[victim], 1),
                        "kvpr_before": self.pressure(w.host, demands, current),
                        "kvpr_after": self.pressure(w.host, demands, after),
                    }
                    self._spawn(self._drain(w, "evict", "idle", detail))

    async def decide(self, kind: str, reason: str, detail: dict[str, Any]) -> None:
        """Keep, count and publish a decision (`detail["outcome"]`: how it went)."""
        decision = PlacementDecision(kind=kind, reason=reason, detail=detail)  # type: ignore[arg-type]
        self.events.append(decision)
        self._count(kind, detail["outcome"])
        await self._announce(decision)

    # ---- what the CLI shows -------------------------------------------------------------------------------

    def hosts(self) -> list[HostInfo]:
        return [seen.info for _, seen in sorted(self._hosts.items())]

    def models(self, workers: dict[str, WorkerInfo]) -> list[ModelPlacement]:
        parked = self.parked()
        return [
            ModelPlacement(
                name=name,
                rate=round(self._rates[name], 3),
                parked=parked.get(name, 0),
                idle_s=self.idle_s(name),
                hosts=sorted({w.host for w in workers.values() if w.model == name and w.state == "active"}),
            )
            for name in self.catalogue
        ]
