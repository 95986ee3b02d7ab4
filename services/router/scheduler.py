"""What this router believes about its workers' load, and its choices among them.

The one owner of the router's scheduling state: requests reserved on each worker since its last
heartbeat, the prompt tokens sent to each and not yet computed (its backlog), the decode slots held by
requests admitted to prefill (claims), the streams each decode worker runs and its recent step times,
the prefix index, and the admission queue where requests wait for room. Who is alive is the
registry's (llmesh_router.registry); the scheduler follows it by subscription, and a heartbeat
replaces what was assumed since the previous one.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

from llmesh.policies import DispatchContext, Policy, PrefixIndex, QueuePolicy, RequestView, WorkerView
from llmesh.policies.baseline import least_loaded
from llmesh.policies.core import Role, fits_request, prompt_blocks
from llmesh.policies.disagg import PrefillSite, StreamProgress, prefill_locally, stall_budget
from llmesh.policies.views import since_heartbeat, worker_view
from llmesh.wire.errors import AtCapacity, MeshError, ModelNotPlaced, ServiceUnavailable
from llmesh.wire.messages import ModelTraffic, WorkerInfo

from .admission import AdmissionQueue
from .registry import WorkerRegistry

log = logging.getLogger(__name__)
STEP_SAMPLES = 64  # a worker's last per-token gaps kept to tell its current decode step time


class Stream(Protocol):
    """A request a decode worker streams, as far as its client has seen it."""

    @property
    def tokens(self) -> int: ...

    def snapshot(self, now: float) -> StreamProgress: ...


@dataclass
class _Load:
    """A worker's load as this router sees it between two of its heartbeats."""

    assigned: int = 0  # requests sent since its last heartbeat
    assigned_blocks: int = 0  # the KV blocks their prompts need (kept until the heartbeat, finished or not)
    released: int = 0  # requests finished since its last heartbeat
    unreachable: bool = False  # NATS found nothing serving it since its last heartbeat: it takes nothing new
    heartbeat_view: WorkerView | None = None  # what the policies see of its heartbeat, built once per heartbeat
    # the last `view`: of which heartbeat view, with which account since (assigned, released, blocks, backlog),
    # kept while neither changes (a pick views every live worker, and most have not changed since the last one)
    viewed: tuple[WorkerView, tuple[int, int, int, int], WorkerView] | None = None


class DecodeClaim:
    """Room on the decode workers that a request admitted to prefill holds until its decode is placed,
    so that the router admits no prompt it could not go on to decode: past the decode pool's room, a
    request waits before its prompt (and is refused with 429 at the door if it waits too long), not
    after its first token, when a refusal could only end its stream with an error."""

    def __init__(self, scheduler: Scheduler, model: str):
        self._scheduler, self.model, self.held = scheduler, model, False

    def take(self) -> None:
        """Claim a decode slot, or raise AtCapacity (every free one is claimed) or ServiceUnavailable
        (no live decode worker serves the model)."""
        self._scheduler.take_claim(self)
        self.held = True

    def release(self) -> None:
        if self.held:
            self._scheduler.release_claim(self)
            self.held = False


class Scheduler:
    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy | None = None,
        *,
        queue_policy: QueuePolicy | None = None,
        max_waiting: int = 1024,
        max_wait_s: float = 30.0,
        max_backlog_s: float | None = None,
        local_prefill_margin_s: float | None = 0.25,
        tpot_slo_s: float = 0.05,
        model_wait_s: float = 60.0,
        seed: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.registry = registry
        self.policy = policy or least_loaded()
        self.admission = AdmissionQueue(
            max_waiting, max_wait_s, queue_policy, self.prefill_seconds, clock, queue_of=self.hosts_of
        )
        self.arrivals: Counter[str] = Counter()  # requests by model since start (`arrived`)
        self.max_backlog_s = max_backlog_s  # llmesh.policies.core.has_room
        self.local_prefill_margin_s = local_prefill_margin_s  # None: always disaggregate
        self.tpot_slo_s = tpot_slo_s
        self.model_wait_s = model_wait_s  # how long a request waits for a worker of a model none serves
        self._rng = random.Random(seed)
        self._clock = clock
        self._load: dict[str, _Load] = defaultdict(_Load)  # worker id -> its load since its last heartbeat
        self._backlog: dict[str, int] = defaultdict(int)  # worker id -> prompt tokens sent it, not yet computed
        self._claims: Counter[str] = Counter()  # model -> requests admitted to prefill, decode not placed
        self._streams: dict[str, dict[str, Stream]] = defaultdict(dict)  # worker id -> request id -> stream
        # worker id -> recent gaps between a stream's tokens; the median is its step time, whatever stalls the
        # last few steps had (a stall lengthens one gap per stream)
        self._token_gaps: dict[str, deque[float]] = defaultdict(lambda: deque(maxlen=STEP_SAMPLES))
        self._dispatched: dict[str, int] = {"prefill": 0, "decode": 0}  # requests sent per role (round-robin's turn)
        self._prefixes = PrefixIndex() if self.policy.needs_prefix else None  # which prompts went where
        registry.subscribe(self._membership_changed)

    # -- what the registry tells: a heartbeat replaces what was assumed since the last one --

    def _membership_changed(self, worker_id: str, info: WorkerInfo | None) -> None:
        self._load.pop(worker_id, None)
        if info is None:  # it left (a request it held still releases its backlog as it ends)
            self._token_gaps.pop(worker_id, None)
            if self._prefixes is not None:
                self._prefixes.forget(worker_id)
        self.admission.room_changed()

    # -- the workers as the policies see them --

    def view(self, info: WorkerInfo) -> WorkerView:
        """What the policies see of a worker: its last heartbeat, what was sent it and finished since,
        and the prompt tokens this router sent it that are not computed yet."""
        load = self._load[info.worker_id]
        if load.heartbeat_view is None:
            view = worker_view(info)
            load.heartbeat_view = replace(view, state="draining") if load.unreachable else view
        account = (load.assigned, load.released, load.assigned_blocks, self._backlog.get(info.worker_id, 0))
        if load.viewed is None or load.viewed[0] is not load.heartbeat_view or load.viewed[1] != account:
            load.viewed = (load.heartbeat_view, account, since_heartbeat(load.heartbeat_view, *account))
        return load.viewed[2]

    def backlog(self, worker_id: str) -> int:
        """Prompt tokens this router sent `worker_id` that it has not computed yet."""
        return self._backlog.get(worker_id, 0)

    def pick(
        self,
        role: Role,
        request: RequestView,
        fingerprint: str | None = None,
        generates: bool = False,
        reserve: bool = True,
    ) -> WorkerInfo:
        """Choose a live worker for `request` by the dispatch policy (with KV layout `fingerprint`,
        among those that run whole requests if `generates`) and count the request against it unless
        not `reserve`d; raise a typed error when none fits."""
        self.registry.check_known(request.model)
        live = {info.worker_id: info for info in self.registry.live()}
        cached = self._prefixes.matches(list(live), request.prefix_hashes) if self._prefixes else {}
        ctx = DispatchContext(
            now=self._clock(),
            rng=self._rng,
            request=request,
            workers=tuple(self.view(info) for info in live.values()),
            role=role,
            fingerprint=fingerprint,
            generates=generates,
            dispatched=self._dispatched[role],
            cached_blocks=cached,
            max_backlog_s=self.max_backlog_s,
        )
        chosen = self.policy.pick(ctx)
        if chosen is None:
            detail = f" with KV fingerprint {fingerprint}" if fingerprint else ""
            if not any(fits_request(ctx, w) for w in ctx.workers):
                if not self.serves(role, request.model):
                    raise ModelNotPlaced(f"no active {role} worker serves {request.model!r} now")
                raise ServiceUnavailable(f"no live {role} worker for {request.model!r}{detail}")
            raise AtCapacity(
                f"no {role} worker for {request.model!r}{detail} can take the request now "
                f"(policy {self.policy.name}: all at capacity or over its threshold)"
            )
        if reserve:
            self.reserve(
                chosen.worker_id,
                request.prompt_tokens if role == "prefill" or generates else 0,
                prompt_blocks(request.prompt_tokens, chosen.block_size),
            )
            if self._prefixes is not None:
                self._prefixes.record(chosen.worker_id, request.prefix_hashes)
        return live[chosen.worker_id]

    # -- reservations: what was sent and finished since each worker's last heartbeat --

    def reserve(self, worker_id: str, prompt_tokens: int = 0, blocks: int = 0) -> None:
        """Count a request sent to `worker_id`, and the KV `blocks` its prompt needs there, until its next
        heartbeat says how loaded it is, and the `prompt_tokens` it is to compute in its backlog until
        `prompt_done`."""
        info = self.registry.get(worker_id)
        if info is not None:
            self._load[worker_id].assigned += 1
            self._load[worker_id].assigned_blocks += blocks
            self._dispatched[info.role] += 1
        self._backlog[worker_id] += prompt_tokens

    def release(self, worker_id: str) -> None:
        """A request `worker_id` held has finished: count its room until the next heartbeat says."""
        if self.registry.get(worker_id) is not None:
            self._load[worker_id].released += 1
        self.admission.room_changed()

    def prompt_done(self, worker_id: str, prompt_tokens: int) -> None:
        """`worker_id` computed (or gave up) a prompt `reserve` counted: out of its backlog."""
        left = self._backlog[worker_id] - prompt_tokens
        if left > 0:
            self._backlog[worker_id] = left
        else:
            self._backlog.pop(worker_id, None)

    def unreachable(self, worker_id: str) -> None:
        """NATS found nothing serving `worker_id`: send it nothing new until its next heartbeat (a
        dead one sends none and is dropped as usual, failing what it held)."""
        if self.registry.get(worker_id) is None or self._load[worker_id].unreachable:
            return
        log.warning("worker %s serves nothing on its subject: no new requests until it beats again", worker_id)
        load = self._load[worker_id]
        load.unreachable, load.heartbeat_view = True, None

    def refused_at_capacity(self, worker_id: str) -> None:
        """`worker_id` refused a request as full: it held its capacity then, whatever this router's
        view of it said (requests sent before its heartbeat reached here, another router's). Count it
        full from now on; each request that ends here frees a slot again, as does its next heartbeat."""
        info = self.registry.get(worker_id)
        if info is not None:
            load = self._load[worker_id]
            load.heartbeat_view = replace(self.view(info), running=info.capacity, assigned=0)
            load.assigned, load.released = 1, 0  # the refused request's reservation, released after this

    # -- decode claims: a prompt is admitted only with room to decode it --

    def decode_room(self, model: str) -> int | None:
        """Requests the active decode workers of `model` take now, by this router's view of them (None:
        there is none)."""
        views = [v for v in map(self.view, self.registry.live("decode")) if v.model == model and v.state == "active"]
        return sum(max(v.capacity - v.running - v.assigned, 0) for v in views) if views else None

    def take_claim(self, claim: DecodeClaim) -> None:
        self.registry.check_known(claim.model)
        room = self.decode_room(claim.model)
        if room is None:
            raise ModelNotPlaced(f"no active decode worker serves {claim.model!r} now")
        if room <= self._claims[claim.model]:
            raise AtCapacity(
                f"the decode workers of {claim.model!r} have room for {room} more requests, all "
                "claimed by prompts admitted before this one"
            )
        self._claims[claim.model] += 1

    def release_claim(self, claim: DecodeClaim) -> None:
        self._claims[claim.model] -= 1

    # -- admission: waiting for room --

    async def admit(
        self,
        role: Role,
        request: RequestView,
        fingerprint: str | None = None,
        claim: DecodeClaim | None = None,
        generates: bool = False,
    ) -> tuple[WorkerInfo, bool]:
        """A worker of `role` for `request` by the dispatch policy (one that runs whole requests if
        `generates`), reserved, and whether the request waited in the queue for it (while none has room). A
        prefill with a decode `claim` also waits for decode room and takes the claim; the decode then
        releases it. Past its prompt (a decode) a request is never refused for waiting: its client has a
        200 and a token."""

        def place() -> WorkerInfo:
            if claim is not None and role == "prefill":
                claim.take()
                try:
                    return self.pick(role, request, fingerprint=fingerprint)
                except BaseException:
                    claim.release()
                    raise
            chosen = self.pick(role, request, fingerprint=fingerprint, generates=generates)
            if claim is not None:
                claim.release()
            return chosen

        # requests of one role, model and layout find room in the same workers, unless the policy holds
        # back some requests but not others
        group: Hashable | None = (
            None if self.policy.declines_by_request else (role, request.model, fingerprint, claim is None)
        )
        self.registry.check_known(request.model)
        unserved = not self.serves(role, request.model) or (
            claim is not None and not self.serves("decode", claim.model)
        )
        return await self.admission.admit(
            place,
            request,
            group,
            committed=role == "decode" and not generates,
            parked_s=self.model_wait_s if unserved else None,
        )

    def arrived(self, model: str) -> None:
        """Count a request of `model` (one the mesh has) in `traffic`."""
        if self.registry.knows(model):
            self.arrivals[model] += 1

    def traffic(self, router_id: str) -> ModelTraffic:
        """Requests by model since this router started, and those parked now (for placement)."""
        return ModelTraffic(router_id=router_id, arrivals=dict(self.arrivals), parked=dict(self.admission.parked()))

    def serves(self, role: Role, model: str) -> bool:
        """Whether an active worker of `role` serves `model` now."""
        return any(self.view(info).state == "active" for info in self.registry.live(role) if info.model == model)

    def hosts_of(self, model: str) -> tuple[str, ...]:
        """The hosts where `model`'s prompts run (its live prefill workers', or decode workers' if it is
        aggregated): its requests' queue (Prism's per device)."""
        return tuple(sorted({w.host for w in self._prompt_workers(model)}))

    def prefill_seconds(self, request: RequestView) -> float:
        """How long `request`'s prompt takes on the fastest live worker that runs its model's prompts (0:
        speed not measured)."""
        speed = max((w.prefill_tokens_per_s for w in self._prompt_workers(request.model)), default=0.0)
        return request.prompt_tokens / speed if speed else 0.0

    def _prompt_workers(self, model: str) -> list[WorkerInfo]:
        """The live workers that run `model`'s prompts: its prefill workers, or decode workers if aggregated."""
        return [w for w in self.registry.live(self.registry.roles(model)[0]) if w.model == model]

    # -- decode workers' streams: what a prompt computed on a decode worker would stall --

    @contextmanager
    def decoding(self, worker_id: str, request_id: str, stream: Stream) -> Iterator[None]:
        """Count `stream` among the streams `worker_id` decodes while the block runs."""
        self._streams[worker_id][request_id] = stream
        try:
            yield
        finally:
            self._streams[worker_id].pop(request_id, None)

    def token_gap(self, worker_id: str, gap_s: float) -> None:
        """A stream on `worker_id` waited `gap_s` per token since its previous delta."""
        self._token_gaps[worker_id].append(gap_s)

    def local_prefill_site(self, request: RequestView, prefill: WorkerInfo) -> WorkerInfo | None:
        """A decode worker to run the whole request when the prefill queue would answer later
        (llmesh.policies.disagg), else None (nothing reserved: `Reservation.prefill_locally` moves it)."""
        try:
            local = self.pick("decode", request, generates=True, reserve=False)
        except MeshError:
            return None
        # This router's own account, not the heartbeat's queued tokens: those are up to a second old,
        # and a finished prompt still counted there would send the next one to a decode worker at idle.
        # (the prefill worker's includes this request's prompt, reserved there)
        remote = PrefillSite(self.backlog(prefill.worker_id) - request.prompt_tokens, prefill.prefill_tokens_per_s)
        here = PrefillSite(self.backlog(local.worker_id), local.prefill_tokens_per_s)
        now = time.monotonic()
        streams = [s.snapshot(now) for s in self._streams[local.worker_id].values() if s.tokens]
        gaps = self._token_gaps[local.worker_id]
        max_stall_s = stall_budget(streams, self.tpot_slo_s, statistics.median(gaps) if gaps else None)
        if not prefill_locally(request.prompt_tokens, remote, here, self.local_prefill_margin_s, max_stall_s):
            return None
        return local

    def reservation(self, model: str) -> Reservation:
        """What a request of `model` is to hold of the workers (see Reservation)."""
        return Reservation(self, model)


class Reservation:
    """What one request holds of the workers from its admission to its end, and the one way it takes any of it:
    a slot on each worker it runs on (counted against the worker until its next heartbeat), its prompt in the
    backlog of the worker computing it, a decode claim from its prompt's admission until its decode is placed
    (DecodeClaim), and its stream among a decode worker's. Closing it gives back whatever is still held,
    however the request ended."""

    def __init__(self, scheduler: Scheduler, model: str):
        self._scheduler = scheduler
        self._claim = DecodeClaim(scheduler, model)
        self._slots: Counter[str] = Counter()  # worker id -> slots held (a migration: its source's and target's)
        self._prompts: dict[str, int] = {}  # worker id -> prompt tokens in its backlog for this request

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *_: object) -> None:
        self._claim.release()
        for worker_id in list(self._slots.elements()):
            self.release(worker_id)

    async def admit(
        self,
        role: Role,
        request: RequestView,
        fingerprint: str | None = None,
        *,
        generates: bool = False,
        claim_decode: bool = False,
    ) -> tuple[WorkerInfo, bool]:
        """A worker of `role` for the request (Scheduler.admit), held here, and whether it waited for it. A prefill
        that `claim_decode`s also takes a decode claim, which the decode's admission then gives back."""
        claim = self._claim if claim_decode or (self._claim.held and role == "decode") else None
        worker, queued = await self._scheduler.admit(role, request, fingerprint, claim, generates)
        self._slots[worker.worker_id] += 1
        if role == "prefill" or generates:
            self._prompts[worker.worker_id] = request.prompt_tokens
        return worker, queued

    def hold(self, worker_id: str) -> None:
        """A slot on `worker_id` without the dispatch policy: a migration's target, or its source resuming."""
        self._scheduler.reserve(worker_id)
        self._slots[worker_id] += 1

    def prefill_locally(self, request: RequestView, prefill: WorkerInfo) -> WorkerInfo | None:
        """Move the request from `prefill` to a decode worker that runs it whole, where the prefill queue would
        answer later (Scheduler.local_prefill_site); its decode slot is then its own, so its claim is given back."""
        local = self._scheduler.local_prefill_site(request, prefill)
        if local is not None:
            tokens = request.prompt_tokens
            self._scheduler.reserve(local.worker_id, tokens, prompt_blocks(tokens, local.block_size))
            self._slots[local.worker_id] += 1
            self._prompts[local.worker_id] = tokens
            self.release(prefill.worker_id)
            self._claim.release()
        return local

    def prompt_done(self, worker_id: str) -> None:
        """`worker_id` computed the request's prompt (or gave it up): out of its backlog."""
        if tokens := self._prompts.pop(worker_id, 0):
            self._scheduler.prompt_done(worker_id, tokens)

    def release(self, worker_id: str) -> None:
        """The request's leg on `worker_id` ended: its slot (and its prompt, if still there) given back."""
        if self._slots[worker_id] <= 0:
            return
        self._slots[worker_id] -= 1
        if not self._slots[worker_id]:
            del self._slots[worker_id]
        self.prompt_done(worker_id)
        self._scheduler.release(worker_id)

    @contextmanager
    def leg(
        self, worker_id: str, request_id: str, stream: Stream, on_lost: Callable[[BaseException], None]
    ) -> Iterator[Leg]:
        """The request's stream from `worker_id` while the block runs: `on_lost(WorkerLost)` called if the worker
        dies, the stream counted among those it decodes (Scheduler.decoding), each delta told to the `Leg`."""
        scheduler = self._scheduler
        with scheduler.registry.watch(worker_id, on_lost), scheduler.decoding(worker_id, request_id, stream):
            yield Leg(self, worker_id)


class Leg:
    """One worker's stream of a request (`Reservation.leg`), told each delta as it comes."""

    def __init__(self, reservation: Reservation, worker_id: str):
        self._reservation, self._scheduler, self.worker_id = reservation, reservation._scheduler, worker_id
        self._previous_at: float | None = None  # its previous delta's (its first follows a prompt or a KV load)

    def heard(self, tokens: int, prompt_computed: bool) -> bool:
        """A delta of `tokens` tokens came: the worker is alive (whatever its heartbeats), the wait per token since
        the previous delta is its pace (for the stall bound), and where it is a whole request's first,
        `prompt_computed` takes the prompt out of the worker's backlog. Whether it was the leg's first."""
        now = time.monotonic()
        self._scheduler.registry.heard_from(self.worker_id)
        first, previous_at, self._previous_at = self._previous_at is None, self._previous_at, now
        if previous_at is not None and tokens:
            self._scheduler.token_gap(self.worker_id, (now - previous_at) / tokens)
        if prompt_computed:
            self._reservation.prompt_done(self.worker_id)
        return first
