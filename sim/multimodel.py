"""A multi-model workload from real traces (issue 33), for the simulator and the benchmarks alike.

How it is built:
- The first models are real services, each its own trace, unchanged: with the Azure 2023 traces,
  model 0 is the conversation service and model 1 the code service, each with its own arrivals and
  lengths.
- Each further model k is a later window of service k mod S (S services), shifted by a whole
  `duration_s` per round so that no two models replay the same arrivals, and thinned to a power-law
  popularity: it keeps each request with probability (S / (k + 1)) ** `popularity` (Zipf ranks
  after the real services; 0 keeps them all).
- A `Burst` squeezes one model's arrivals: those of `length_s * factor` seconds from `start_s` arrive
  within `length_s`, and what follows moves up (that model's window is read that much longer), so a
  burst raises its rate `factor`-fold and the rest of its trace goes on after it.
- A window past a trace's end wraps around to its start.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

TraceRow = tuple[float, int, int, tuple[int, ...]]  # arrival s from the first, prompt and output tokens, block ids


@dataclass(frozen=True)
class Arrival:
    at_s: float
    model: str
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Burst:
    model: str
    start_s: float
    length_s: float
    factor: float  # the rate within the burst over the model's own

    def warp(self, t: float) -> float:
        """When an arrival at `t` of the unsqueezed window comes."""
        if t < self.start_s:
            return t
        if t < self.start_s + self.length_s * self.factor:
            return self.start_s + (t - self.start_s) / self.factor
        return t - self.length_s * (self.factor - 1)


def model_name(k: int) -> str:
    return f"model-{k}"


def multimodel_workload(
    services: Sequence[Sequence[TraceRow]],
    models: int,
    duration_s: float,
    popularity: float = 1.0,
    bursts: Sequence[Burst] = (),
    seed: int = 0,
) -> list[Arrival]:
    """`models` models' arrivals over `duration_s` from the `services`' traces (see the module's
    docstring), in arrival order. Deterministic for a `seed`."""
    if not services or any(not rows for rows in services):
        raise ValueError("every service needs a trace with requests")
    rng = random.Random(seed)
    out: list[Arrival] = []
    for k in range(models):
        name = model_name(k)
        own = sorted((b for b in bursts if b.model == name), key=lambda b: b.start_s)
        for earlier, later in zip(own, own[1:]):
            if later.start_s < earlier.start_s + earlier.length_s:
                raise ValueError(f"bursts of {name} overlap")
        rows = services[k % len(services)]
        keep = 1.0 if k < len(services) else (len(services) / (k + 1)) ** popularity
        start = (k // len(services)) * duration_s
        length = duration_s + sum(b.length_s * (b.factor - 1) for b in own)
        for at, prompt, output in _window(rows, start, length):
            if keep < 1.0 and rng.random() >= keep:
                continue
            for burst in own:
                at = burst.warp(at)
            if at < duration_s:
                out.append(Arrival(at, name, prompt, output))
    return sorted(out, key=lambda a: (a.at_s, a.model))


def _window(rows: Sequence[TraceRow], start_s: float, length_s: float) -> list[tuple[float, int, int]]:
    """The requests of `rows` arriving in [start_s, start_s + length_s), from 0; past the trace's end
    it wraps around (the trace repeats with the mean gap between its last and first request)."""
    span = rows[-1][0] + (rows[-1][0] - rows[0][0]) / max(len(rows) - 1, 1) or 1.0
    out = []
    lap = int(start_s // span)
    while lap * span < start_s + length_s:
        for t, prompt, output, _ in rows:
            at = lap * span + t
            if start_s <= at < start_s + length_s:
                out.append((at - start_s, prompt, output))
        lap += 1
    return out
