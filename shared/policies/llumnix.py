"""Llumnix's freeness-based dispatch and migration pairing (Sun et al., OSDI 2024, §4.4).

Each request on an instance has a virtual usage: the KV blocks it fills, or for a request still
waiting to run its demand, plus, on an instance holding high-priority requests, a headroom they
share (so that new load stays away from them). An instance's freeness is F = (M − ΣV) / B: its total
blocks M minus the virtual usage, per request in its batch B; a draining instance has infinite usage
(F = −∞), so its requests are the first to move away. Which waiting requests count: the paper (§4.4.3)
counts the head-of-line one alone, whose demand is what fragmentation blocks, and so does its code
for migration (`RemainingStepsLoad` with `enable_defrag`); its code's dispatch counts them all
(`head_of_line`). New requests go to the freest instance; the placement service pairs the least free
instances (sources) with the freest (destinations) by the head-of-line measure and migrates the
request cheapest to move from each source (`pick_migration`), and reads the cluster's average
freeness as scaling advice (`scaling_advice`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llmesh.policies.core import DispatchContext, Policy, WorkerView, lowest_cost_below
from llmesh.wire.messages import RequestProgress


def freeness(w: WorkerView, priority_headroom_blocks: int = 0, head_of_line: bool = False) -> float:
    """F = (M − ΣV) / B; −∞ for a draining worker. Each request's virtual usage V is the blocks it
    fills (a waiting one: the blocks its prompt needs), plus the headroom kept free beside the
    high-priority ones; `head_of_line`: of the waiting requests, only the first counts, in V and in B
    (`WorkerView.engine_queue`). A worker that reports no request list counts the blocks it reports in use. The
    requests a dispatcher sent since the heartbeat count too, with their prompts' blocks: without them
    every request sent within a heartbeat's period goes to the one worker that was freest at its start
    (measured in the simulator with the router's views: P99 prefill 27× round-robin's)."""
    if w.state == "draining":
        return float("-inf")
    return (w.kv_blocks_total - virtual_usage(w, priority_headroom_blocks, head_of_line)) / max(
        batch(w, head_of_line), 1
    )


def counted_requests(w: WorkerView, head_of_line: bool = False) -> tuple[RequestProgress, ...]:
    """The requests whose virtual usage counts: all, or the running ones and the head of line."""
    if not head_of_line:
        return w.requests
    running, waiting = w.engine_queue
    return running + waiting[:1]


def virtual_usage(w: WorkerView, priority_headroom_blocks: int = 0, head_of_line: bool = False) -> int:
    """ΣV of `freeness`: the KV blocks its counted requests hold or wait for, plus the headroom beside
    high-priority ones (once per worker: they share it)."""
    if w.requests:
        if head_of_line:
            held = sum(r.kv_blocks(w.block_size) for r in counted_requests(w, head_of_line))
        else:
            held = w.held_kv_blocks  # cached on the view: every request's
        held += priority_headroom_blocks * any(r.priority < 0 for r in w.requests)
    else:
        held = w.kv_blocks_used
    return held + w.assigned_blocks


def batch(w: WorkerView, head_of_line: bool = False) -> int:
    """B of `freeness`: the requests counted on `w`, and those sent it since its heartbeat."""
    return (len(counted_requests(w, head_of_line)) or w.running) + w.assigned


def freeness_with_one_fewer(
    workers: Sequence[WorkerView], leaving: WorkerView, priority_headroom_blocks: int = 0
) -> float:
    """The freeness the others would have, pooled, once `leaving` is gone and its requests have moved to them:
    their free blocks less what those requests hold, per request of all of them."""
    usage = sum(virtual_usage(w, priority_headroom_blocks) for w in workers)
    total = sum(w.kv_blocks_total for w in workers if w is not leaving)
    return (total - usage) / max(sum(batch(w) for w in workers), 1)


def llumnix(priority_headroom_blocks: float = 0, queue_below: float = float("-inf"), head_of_line: float = 0) -> Policy:
    """Dispatch to the freest worker. `head_of_line` (1): count only the head of each worker's queue, as
    the paper's text does; by default every waiting request counts, as Llumnix's code dispatches (measured
    better: docs/sim/llumnix-*.md). With `queue_below`, the request waits in the router's queue while even
    the freest worker's freeness is under it (as BanaServe's global queue, on Llumnix's measure: 0 holds
    requests back once their virtual usage would overcommit the KV blocks), so the queue policy, not the
    engines' arrival order, decides who goes first."""
    headroom = int(priority_headroom_blocks)
    if headroom < 0:
        raise ValueError(f"llumnix: priority_headroom_blocks must be >= 0, not {priority_headroom_blocks}")
    if head_of_line not in (0, 1):
        raise ValueError(f"llumnix: head_of_line must be 0 or 1, not {head_of_line}")

    def unfreeness(ctx: DispatchContext, w: WorkerView) -> float:
        return -freeness(w, headroom, bool(head_of_line))

    return Policy(
        "llumnix",
        costs=((1.0, unfreeness),),
        picker=lowest_cost_below(-queue_below),
        params={"priority_headroom_blocks": headroom, "queue_below": queue_below, "head_of_line": head_of_line},
    )


def migration_pairs(
    workers: Sequence[WorkerView], source_below: float, destination_above: float, priority_headroom_blocks: int = 0
) -> list[tuple[WorkerView, WorkerView]]:
    """(source, destination) pairs for migration: the least free workers under `source_below`
    (draining ones first) matched in order with the freest over `destination_above`, by the head-of-line
    freeness (Llumnix's de-fragmentation: a source's blocked head of line is what moving a request
    out frees room for); each worker in at most one pair, and never a draining worker as a destination."""
    scored = sorted(
        ((freeness(w, priority_headroom_blocks, head_of_line=True), w.worker_id, w) for w in workers),
        key=lambda t: (t[0], t[1]),
    )
    sources = [w for f, _, w in scored if f < source_below and w.requests]
    destinations = [w for f, _, w in reversed(scored) if f > destination_above and w.state == "active"]
    pairs, used = [], set()
    for src, dst in zip(sources, destinations):
        if src.worker_id in used or dst.worker_id in used or src.worker_id == dst.worker_id:
            break
        pairs.append((src, dst))
        used |= {src.worker_id, dst.worker_id}
    return pairs


def pick_migration(source: WorkerView) -> RequestProgress | None:
    """The request to move off `source`, as Llumnix chooses it: the least urgent priority first
    (vLLM's convention: the highest number), then the fewest tokens (prompt and output so far:
    the least KV to copy, and still its whole share of the batch freed); ties by id. Never one
    already migrating, nor one whose prompt is not computed yet (it has no KV to hand over)."""
    movable = [r for r in source.requests if not r.migrating and not r.prefilling]
    return min(movable, key=lambda r: (-r.priority, r.prompt_tokens + r.generated, r.request_id), default=None)


def scaling_advice(workers: Sequence[WorkerView], low: float, high: float, priority_headroom_blocks: int = 0) -> int:
    """Llumnix's freeness band over the active decode workers that report their KV blocks: +1 (add an
    instance) when their average freeness is below `low`, -1 (one can go) when above `high` and
    more than one runs, else 0; 0 with none."""
    active = [w for w in workers if w.role == "decode" and w.state == "active" and w.kv_blocks_total]
    if not active:
        return 0
    average = sum(freeness(w, priority_headroom_blocks) for w in active) / len(active)
    if average < low:
        return 1
    return -1 if average > high and len(active) > 1 else 0


@dataclass(frozen=True)
class ScaleHold:
    """The freeness seen over the last scale-down window, since when it has been watched (after the last action)."""

    # (time, mean freeness of the active decode workers, their pooled freeness with one fewer)
    samples: tuple[tuple[float, float, float], ...] = ()
    since: float | None = None  # the first sample since the last action or settling


def scale_decision(
    freeness_now: float | None,
    with_one_fewer: float,
    instances: int,
    now: float,
    hold: ScaleHold,
    window_s: float,
    down_window_s: float,
    low: float,
    high: float,
    minimum: int,
    maximum: int,
) -> tuple[int, ScaleHold, float | None]:
    """Llumnix's autoscaling: +1 (start an instance) when the mean freeness of the instances, averaged over the
    last `window_s`, is below `low`; -1 (drain one) when above `high` and the instances left would stay at
    or above `low` (`with_one_fewer`, `freeness_with_one_fewer`), both averaged over the last
    `down_window_s` (at least `window_s`: a lull of seconds between bursts is no reason to drain what the
    next burst needs, as autoscalers stabilise scale-downs); only once it has been watched for the
    action's whole window since the last action, and within [`minimum`, `maximum`] instances
    (below `minimum`: +1 at once). The average, not every sample: at the band's edge the instantaneous
    freeness crosses it back and forth every second, and a streak never lasted (measured: a scale-up 78 s
    late with a 5 s window). The projection: an instance just started is empty, which lifts the mean over
    `high` while the others are as full as when they asked for it (measured: drained 11 s after it
    joined, then started again cold). `freeness_now`: None while an action is settling (an instance
    starting or draining). Returns the action (0: none), the hold to pass next time and the window's
    average (None: no sample)."""
    if instances < minimum:
        return 1, ScaleHold(), None
    if freeness_now is None:
        return 0, ScaleHold(), None
    down_window_s = max(down_window_s, window_s)
    samples = tuple(s for s in hold.samples if s[0] > now - down_window_s) + ((now, freeness_now, with_one_fewer),)
    since = now if hold.since is None else hold.since
    recent = [s for s in samples if s[0] > now - window_s] or [samples[-1]]
    average = sum(s[1] for s in recent) / len(recent)
    action = 0
    if now - since >= window_s and average < low and instances < maximum:
        action = 1
    elif now - since >= down_window_s and instances > minimum:
        mean, fewer = (sum(s[i] for s in samples) / len(samples) for i in (1, 2))
        action = -1 if mean > high and fewer >= low else 0
    return action, (ScaleHold() if action else ScaleHold(samples, since)), average
