"""The contract every dispatch policy follows, and the pipeline that runs one.

A policy sees one `DispatchContext`: the time, a seeded random source, the request and a
snapshot of each worker. It filters the workers (model, KV fingerprint, state, room), gives
each survivor a cost (a weighted sum of cost functions; lower is better) and picks one, as
llm-d's scheduler separates filters, scorers and pickers. A picker may decline (None): every
worker is past the policy's threshold and the request should wait in the queue.

Everything here is pure: no I/O, no clock reads, no hidden state. Round-robin's position is
`ctx.dispatched`, which the caller counts. The router, the placement service and the simulator
build contexts and call `Policy.pick`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

from llmesh.wire.messages import RequestProgress, Role, kv_blocks

State = Literal["active", "draining"]


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """The KV blocks a request of `prompt_tokens` needs to start: its prompt and its first output token
    (0 where the worker reports no block size)."""
    return kv_blocks(prompt_tokens + 1, block_size) if block_size else 0


@dataclass(frozen=True)
class RequestView:
    """What a policy knows of the request it places."""

    request_id: str
    model: str
    prompt_tokens: int  # estimated before tokenization
    arrival: float  # monotonic seconds, same clock as `DispatchContext.now`
    deadline: float
    max_tokens: int | None = None
    predicted_tokens: float | None = None  # the length predictor's expected output tokens (None: no prediction)
    prediction_confidence: float = 0.0
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0  # vLLM's convention: lower is more urgent, below 0 is high priority
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of its prompt's leading blocks (for prefix affinity)
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)

    @property
    def ttft_deadline(self) -> float:
        """When its first token is due: arrival + its TTFT target (none: its overall deadline)."""
        return self.arrival + self.ttft_slo_s if self.ttft_slo_s is not None else self.deadline


@dataclass(frozen=True)
class WorkerView:
    """A worker as its last heartbeat showed it, plus what this dispatcher sent it since."""

    worker_id: str
    role: Role
    model: str
    fingerprint: str
    capacity: int  # requests it accepts at once
    running: int  # requests it holds
    queued_tokens: int = 0  # prompt tokens (prefill) or remaining output budget (decode) in flight
    assigned: int = 0  # requests this dispatcher sent it since that heartbeat
    state: State = "active"
    generates: bool = False  # runs whole requests, prefill included
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0  # 0: not reported
    block_size: int = 0
    prefill_tokens_per_s: float = 0.0
    requests: tuple[RequestProgress, ...] = ()  # as its heartbeat reports them
    roles: tuple[Role, ...] = ()  # the roles it can serve (both: it switches on command; empty: `role` only)
    sent_backlog: int = 0  # prompt tokens the caller sent it that are not computed yet, by the caller's account
    assigned_blocks: int = 0  # the KV blocks the prompts of the `assigned` requests need, by the caller's account
    loaded_adapters: frozenset[str] = frozenset()  # the LoRA adapters its engine holds loaded now

    @property
    def load(self) -> float:
        """Requests held or on their way, relative to capacity."""
        return (self.running + self.assigned) / max(self.capacity, 1)

    @property
    def has_room(self) -> bool:
        return self.running + self.assigned < self.capacity

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0 when not reported)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @cached_property
    def prefill_backlog(self) -> int:
        """Prompt tokens it holds that are not computed yet (from its request list)."""
        return sum(r.prompt_tokens for r in self.requests if r.prefilling)

    @cached_property
    def held_kv_blocks(self) -> int:
        """KV blocks its requests fill at their whole prompt and output so far (a request still waiting
        counts its prompt's blocks)."""
        return sum(r.kv_blocks(self.block_size) for r in self.requests)

    @cached_property
    def engine_queue(self) -> tuple[tuple[RequestProgress, ...], tuple[RequestProgress, ...]]:
        """Its requests as its engine holds them, (running, waiting), by vLLM's first-come admission: those
        with output run, then, in the heartbeat's order, each prompt whose blocks fit beside them, until the
        first that does not: it and those after it wait (it is the head of line). A worker that reports no
        KV blocks: all run."""
        if not (self.kv_blocks_total and self.block_size):
            return self.requests, ()
        running = [r for r in self.requests if not r.prefilling]
        used = sum(r.kv_blocks(self.block_size) for r in running)
        prompts = [r for r in self.requests if r.prefilling]
        for i, r in enumerate(prompts):
            used += r.kv_blocks(self.block_size)
            if used > self.kv_blocks_total:
                return tuple(running), tuple(prompts[i:])
            running.append(r)
        return tuple(running), ()

    def ttft_estimate_s(self, prompt_tokens: int) -> float | None:
        """A new prompt's time to first token here: its backlog of prompts, then this one, at the
        measured prefill speed; infinite when its KV blocks and those every request held fills
        (`held_kv_blocks`) would overcommit the worker's, since it would then wait for others to
        finish (None: speed not measured)."""
        if not self.prefill_tokens_per_s:
            return None
        if self.kv_blocks_total and self.block_size:
            if prompt_blocks(prompt_tokens, self.block_size) + self.held_kv_blocks > self.kv_blocks_total:
                return math.inf
        return (self.prefill_backlog + prompt_tokens) / self.prefill_tokens_per_s


@dataclass(frozen=True)
class DispatchContext:
    now: float
    rng: random.Random
    request: RequestView
    workers: tuple[WorkerView, ...]
    role: Role
    fingerprint: str | None = None  # required KV layout (a decode after a prefill)
    generates: bool = False  # only workers that run whole requests
    dispatched: int = 0  # requests the caller has placed before this one
    cached_blocks: Mapping[str, int] = field(default_factory=dict)  # worker id -> leading blocks of the request's
    # prompt the caller's prefix index says it computed (policies.prefix; only for policies that read it)
    max_backlog_s: float | None = None  # a prefill worker has room only while the prompts the caller sent it,
    # this one included, take at most this long at its measured speed (None: no bound; requests past it wait in
    # the caller's queue, in its queue policy's order, instead of on the worker)


Filter = Callable[[DispatchContext, WorkerView], bool]
Cost = Callable[[DispatchContext, WorkerView], float]
Picker = Callable[[DispatchContext, Sequence[tuple[WorkerView, float]]], "WorkerView | None"]


# ---- filters ------------------------------------------------------------------------------------------------


def fits_request(ctx: DispatchContext, w: WorkerView) -> bool:
    """The role, model and KV layout the request needs, on an active worker (a draining one takes
    nothing new), among those that run whole requests when asked."""
    return (
        w.role == ctx.role
        and w.model == ctx.request.model
        and w.state == "active"
        and (ctx.fingerprint is None or w.fingerprint == ctx.fingerprint)
        and (w.generates or not ctx.generates)
    )


def has_room(ctx: DispatchContext, w: WorkerView) -> bool:
    """A free slot, and for a prefill under `ctx.max_backlog_s`, few enough prompts from the caller
    before this one. The caller's own account, not the heartbeat's request list: that is up to a
    heartbeat old, and its prompts computed since would hold new ones back for nothing (measured: a
    second's bound halved a saturated mesh's throughput). Several callers each keep to the bound."""
    if not w.has_room:
        return False
    if ctx.role != "prefill" or ctx.max_backlog_s is None or not w.prefill_tokens_per_s or not w.sent_backlog:
        return True  # speed not measured, or nothing sent yet: an idle worker takes any prompt
    return (w.sent_backlog + ctx.request.prompt_tokens) / w.prefill_tokens_per_s <= ctx.max_backlog_s


STANDARD_FILTERS: tuple[Filter, ...] = (fits_request, has_room)


def adapter_holders(ctx: DispatchContext, workers: list[WorkerView]) -> list[WorkerView]:
    """For a request with a LoRA adapter, of the workers that passed the filters (room among them: a prefill
    worker's backlog bound too), those whose engines hold it loaded, if any; else all of them (the one picked
    loads it from its folder). A loaded adapter is preferred only among workers that take the request now: it
    saves reading an adapter, and sharing a batch with its other requests (vLLM runs at most max_loras
    adapters a step), never a wait in a queue."""
    adapter = ctx.request.adapter
    holders = [w for w in workers if adapter in w.loaded_adapters] if adapter is not None else []
    return holders or workers


# ---- costs --------------------------------------------------------------------------------------------------


def request_load(ctx: DispatchContext, w: WorkerView) -> float:
    """Requests held or on their way, relative to capacity."""
    return w.load


def queued_tokens(ctx: DispatchContext, w: WorkerView) -> float:
    return float(w.queued_tokens)


# ---- pickers ------------------------------------------------------------------------------------------------


def lowest_cost(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
    """The cheapest worker; ties broken by the seeded rng over workers sorted by id."""
    if not scored:
        return None
    best = min(cost for _, cost in scored)
    tied = sorted(
        (w for w, cost in scored if math.isclose(cost, best, rel_tol=1e-12, abs_tol=1e-12)), key=lambda w: w.worker_id
    )
    return tied[0] if len(tied) == 1 else ctx.rng.choice(tied)


def lowest_cost_below(threshold: float) -> Picker:
    """`lowest_cost`, but None (the request waits) when even the cheapest costs `threshold` or more."""

    def pick(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
        affordable = [(w, cost) for w, cost in scored if cost < threshold]
        return lowest_cost(ctx, affordable)

    return pick


def uniform(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
    """Any worker, uniformly at random."""
    ordered = sorted((w for w, _ in scored), key=lambda w: w.worker_id)
    return ctx.rng.choice(ordered) if ordered else None


def in_turn(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
    """The next worker in id order after the caller's `dispatched` count."""
    ordered = sorted((w for w, _ in scored), key=lambda w: w.worker_id)
    return ordered[ctx.dispatched % len(ordered)] if ordered else None


def cheaper_of_two(ctx: DispatchContext, scored: Sequence[tuple[WorkerView, float]]) -> WorkerView | None:
    """Power of two choices (Mitzenmacher): two workers at random, the cheaper one (the first on a tie)."""
    ordered = sorted(scored, key=lambda ws: ws[0].worker_id)
    if len(ordered) < 2:
        return ordered[0][0] if ordered else None
    a, b = ctx.rng.sample(ordered, 2)
    return b[0] if b[1] < a[1] else a[0]


# ---- the pipeline -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    """A named dispatch policy: filters, weighted costs, a picker."""

    name: str
    costs: tuple[tuple[float, Cost], ...] = ()
    picker: Picker = lowest_cost
    filters: tuple[Filter, ...] = STANDARD_FILTERS
    needs_prediction: bool = False  # reads `RequestView.predicted_tokens`: the caller waits for it
    needs_prefix: bool = False  # reads `DispatchContext.cached_blocks`: the caller keeps a prefix index
    declines_by_request: bool = False  # may hold back one request and place the next on the same workers (a
    # caller serving a queue may otherwise stop trying a role once one request of it was held back)
    params: dict[str, float] = field(default_factory=dict)  # as configured, for logs and traces

    def cost(self, ctx: DispatchContext, worker: WorkerView) -> float:
        return sum(weight * cost(ctx, worker) for weight, cost in self.costs)

    def candidates(self, ctx: DispatchContext) -> list[WorkerView]:
        return adapter_holders(ctx, [w for w in ctx.workers if all(keep(ctx, w) for keep in self.filters)])

    def pick(self, ctx: DispatchContext) -> WorkerView | None:
        """The worker for `ctx.request`, or None when no worker fits or the policy holds it back."""
        return self.picker(ctx, [(w, self.cost(ctx, w)) for w in self.candidates(ctx)])
