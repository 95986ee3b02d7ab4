"""Where models run: Prism's placement by KV pressure (Algorithm 1) and its idle eviction (its Algorithm 2,
the queue order, is `llmesh.policies.queueing.prism`).

A device's KV pressure ratio is the sum over the models on it of request rate over SLO, divided by
the memory left for their KV once their weights are in (Prism, §4). Placement goes through the
models by rate over SLO, highest first, and puts each on the device with the lowest pressure where
its weights fit, one tensor-parallel part a device; a model already placed moves only when the
pressure it would leave behind exceeds the pressure it would meet by more than `move_threshold`
(Prism's τ). Run again as measured rates change; the caller carries out the difference (activate on
the target, migrate or drain the source, evict).

Pure functions over snapshots, as every policy here: placement, the simulator and tests call them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDemand:
    """A model as placement weighs it."""

    name: str
    rate: float  # requests/s, measured
    slo_s: float  # its time-to-first-token target
    weights_bytes: int  # one tensor-parallel part's weights
    parts: int = 1  # tensor-parallel parts, each on its own device

    @property
    def weight(self) -> float:
        """Rate over SLO: how much KV memory it should get relative to the others."""
        return self.rate / self.slo_s


@dataclass(frozen=True)
class Device:
    device_id: str
    memory_bytes: int  # for weights and KV together


@dataclass
class _Load:
    weight: float = 0.0  # sum of rate / SLO of the models on it
    free_bytes: int = 0  # memory left for KV


def kv_pressure(weight: float, free_bytes: int) -> float:
    """Prism's KV pressure ratio: rate over SLO per byte of KV memory (inf with none left)."""
    return weight / free_bytes if free_bytes > 0 else float("inf")


def place_models(
    models: Sequence[ModelDemand],
    devices: Sequence[Device],
    current: Mapping[str, Iterable[str]] | None = None,
    move_threshold: float = 0.0,
) -> dict[str, tuple[str, ...]]:
    """Prism's Algorithm 1: model name -> the devices its parts run on (a model whose weights fit
    nowhere is left out). `current`: where models run now (kept unless moving gains more than
    `move_threshold` in pressure). Deterministic: ties go to the device listed first."""
    loads = {d.device_id: _Load(free_bytes=d.memory_bytes) for d in devices}
    placed: dict[str, tuple[str, ...]] = {}
    now = {name: tuple(ids) for name, ids in (current or {}).items()}
    for model in sorted(models, key=lambda m: (-m.weight, m.name)):
        chosen: list[str] = []
        for part in range(model.parts):
            stay = now.get(model.name, ())[part : part + 1]
            target = _best_device(model, loads, exclude=set(chosen))
            if stay and stay[0] in loads and stay[0] not in chosen and _fits(model, loads[stay[0]]):
                if (
                    target is None
                    or _pressure_with(model, loads[stay[0]]) - _pressure_with(model, loads[target]) <= move_threshold
                ):
                    target = stay[0]
            if target is None:
                break
            chosen.append(target)
            load = loads[target]
            load.weight += model.weight
            load.free_bytes -= model.weights_bytes
        if len(chosen) == model.parts:
            placed[model.name] = tuple(chosen)
        else:  # not every part fits: give back what was taken
            for device_id in chosen:
                load = loads[device_id]
                load.weight -= model.weight
                load.free_bytes += model.weights_bytes
    return placed


def _fits(model: ModelDemand, load: _Load) -> bool:
    return load.free_bytes > model.weights_bytes  # room for its weights and some KV


def _pressure_with(model: ModelDemand, load: _Load) -> float:
    return kv_pressure(load.weight + model.weight, load.free_bytes - model.weights_bytes)


def _best_device(model: ModelDemand, loads: Mapping[str, _Load], exclude: set[str]) -> str | None:
    """The device with the lowest pressure now where the model's weights fit (None: nowhere)."""
    fitting = [d for d, load in loads.items() if d not in exclude and _fits(model, load)]
    return min(fitting, key=lambda d: kv_pressure(loads[d].weight, loads[d].free_bytes), default=None)


def kv_shares(pending: Mapping[str, float], free_bytes: int) -> dict[str, int]:
    """Prism's split of a device's KV memory by rate over SLO, for engines whose KV space is fixed when they
    start (vLLM's on CPU, and on GPU without elastic KV): the memory free now (`free_bytes`, once the
    pending models' weights are in) goes to the models that hold nothing on the device yet (`pending`:
    name -> rate over SLO), each in proportion to its weight. A model without a measured rate counts as the
    least weighted one with one (equal shares while none has one): it may come, and fixed KV cannot be
    taken back from the others."""
    if free_bytes <= 0 or not pending:
        return {name: 0 for name in pending}
    floor = min((w for w in pending.values() if w > 0), default=1.0)
    weights = {name: w if w > 0 else floor for name, w in pending.items()}
    total = sum(weights.values())
    return {name: round(free_bytes * w / total) for name, w in weights.items()}


def idle_evictions(
    models: Sequence[ModelDemand],
    placement: Mapping[str, Iterable[str]],
    idle_s: Mapping[str, float],
    short_bytes: Mapping[str, int],
    idle_after_s: float,
) -> list[str]:
    """Prism's idle eviction: of the models idle past `idle_after_s` on devices short of memory
    (`short_bytes`: device -> bytes it lacks), those to evict, larger SLOs first, until each such
    device has the memory it lacks."""
    by_name = {m.name: m for m in models}
    lacking = {d: n for d, n in short_bytes.items() if n > 0}
    evicted: list[str] = []
    idle = [name for name in placement if idle_s.get(name, 0.0) >= idle_after_s and name in by_name]
    for name in sorted(idle, key=lambda n: (-by_name[n].slo_s, n)):
        devices = [d for d in placement[name] if lacking.get(d, 0) > 0]
        if not devices:
            continue
        evicted.append(name)
        for d in placement[name]:
            if d in lacking:
                lacking[d] -= by_name[name].weights_bytes
    return evicted
