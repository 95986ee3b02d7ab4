"""A model of one engine: continuous batching with chunked prefill, as vLLM's scheduler runs it.

Each step computes up to `max_batched_tokens` of prompt (oldest first, a prompt may span steps)
plus one token for every request already decoding. Its time is
`step_s = base_s + prefill_token_s · prompt tokens + prefill_attention_s · prompt attention pairs
+ decode_seq_s · decoding requests + context_token_s · their context`, where a chunk of c prompt
tokens after k already computed attends to c·k + c(c+1)/2 (token, earlier token) pairs: prefill
attention is quadratic in the prompt, which dominates long prompts on a GPU. A prompt's first
token comes at the end of the step that computes its last chunk. KV memory is counted in blocks; a
request is admitted to the batch only when its prompt's blocks are free, and holds its blocks until it finishes.

Prefix reuse: a request carrying its prompt's block hashes (`prefix_hashes`, `prefix_block_tokens`
tokens each, as the Mooncake traces give them) skips the leading blocks its engine's prefix cache
holds: vLLM's own per-instance cache (free, in device memory) or the mesh's global KV store
(shared by every engine, each hit costing `PrefixCache.load_token_s` a token to bring in). Its
blocks enter the cache once its prompt is computed.

KV pressure: without a `Preemption`, a request holds the blocks of its prompt from admission and its
output grows past them unchecked (the engine is sized for its load). With one, as vLLM: before each
step, the decoding requests' next tokens must fit; if they do not, a victim leaves the batch (vLLM's:
the request admitted last; AdaptiveLLM's: the lowest fairness priority), its KV moved to CPU memory
(swap: the blocks' copy time in this step, and again in the step that brings it back) or dropped (recompute:
its prompt and output so far computed again when it resumes), and nobody is admitted that step.

Roles, as in the mesh: a "prefill" engine hands a request on once its first token is out; a
"decode" engine takes requests whose KV arrived (their prompt needs no compute) or, as a
monolithic engine, whole requests.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from llmesh.policies.core import RequestView, kv_blocks
from llmesh.policies.preemption import Choice, swap_or_recompute
from llmesh.policies.prefix import PrefixIndex
from llmesh.policies.queueing import fairness


@dataclass(frozen=True)
class EngineProfile:
    name: str
    base_s: float  # fixed cost of a step
    prefill_token_s: float  # per prompt token computed in the step
    decode_seq_s: float  # per request decoding in the step
    context_token_s: float = 0.0  # per token of context of the decoding requests (attention)
    prefill_attention_s: float = 0.0  # per (prompt token, earlier token it attends to) pair computed
    max_batched_tokens: int = 2048
    max_seqs: int = 256
    kv_blocks: int = 4096
    block_size: int = 16
    kv_transfer_token_s: float = 0.0  # prefill to decode, per prompt token, beyond what overlaps the prefill
    source: str = ""  # where the numbers come from
    # vLLM V0's default scheduler (no chunked prefill): a step that computes prompts decodes nothing, so
    # every arriving prompt stalls the running streams; False: V1's chunked prefill, prompts and decodes mixed
    prefill_first: bool = False
    # from a request's submission to its first token leaving the engine, beyond the steps' time (input
    # processing, the wait for a step boundary, output): every token a client sees comes this much after its
    # step; measured on a real engine (`llmesh_sim.calibrate`), 0 in profiles of GPU kernel times
    first_token_s: float = 0.0

    def step_s(self, prefill_tokens: int, decoding: int, context_tokens: int, attention_pairs: int = 0) -> float:
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_attention_s * attention_pairs
            + self.decode_seq_s * decoding
            + self.context_token_s * context_tokens
        )

    def prefill_s(self, prompt_tokens: int) -> float:
        """A lone prompt's time in one step (its time to first token on an idle engine)."""
        return self.step_s(prompt_tokens, 0, 0, attention_pairs(0, prompt_tokens))


def attention_pairs(done: int, chunk: int) -> int:
    """(token, earlier token) pairs a chunk of `chunk` prompt tokens after `done` computed ones attends to."""
    return chunk * done + chunk * (chunk + 1) // 2


@dataclass(eq=False)
class SimRequest:
    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    priority: int = 0
    predicted_tokens: float | None = None
    prefix_hashes: tuple[int, ...] = ()  # its prompt's blocks (equal hashes: equal prefixes)
    model: str = "sim"
    # filled in as it runs
    prefilled: int = 0
    cached_tokens: int = 0  # of its prompt, found in a prefix cache instead of computed
    queued_at: float | None = None  # when it last started waiting in the router's queue
    generated: int = 0
    dispatched_at: float | None = None
    worker_id: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    refused: bool = False
    # what a live worker also reports of a request (llmesh.wire.messages.RequestProgress, read by name) and the
    # simulator does not model: live migration, refined length predictions
    migrating: bool = False
    predicted_remaining: float | None = None
    remaining_at: int = 0
    # preemption (`Preemption`)
    recomputing: int = 0  # output tokens its prompt computes again (it resumed by recompute)
    swapped_blocks: int = 0  # KV blocks it holds in CPU memory (swapped out)
    preemptions: int = 0
    swaps: int = 0  # of its preemptions, those that swapped
    preempted_s: float = 0.0  # what its preemptions cost: blocks copied, or its tokens' prefill time computed again
    requeued_s: float = 0.0  # time spent back in the queue after its preemptions
    preempted_at: float | None = None  # when its last preemption sent it back to the queue (None: not waiting for that)
    # live migration (sim.cluster.Migration)
    migrations: int = 0
    paused_until: float = 0.0  # no decoding before this: its KV's last stage is on its way to a new engine
    # the gaps between its output tokens (time between tokens, per step)
    last_token_at: float | None = None
    tbt_max_s: float = 0.0
    tbt_misses: int = 0  # gaps longer than its `tpot_slo_s`

    def token_out(self, now: float) -> None:
        """One more output token at `now`: the gap since the last one counts."""
        if self.last_token_at is not None:
            gap = now - self.last_token_at
            self.tbt_max_s = max(self.tbt_max_s, gap)
            self.tbt_misses += self.tpot_slo_s is not None and gap > self.tpot_slo_s
        self.last_token_at = now

    @property
    def prefill_target(self) -> int:
        """The tokens its prefill computes: its prompt, and the output it had when preempted to recompute."""
        return self.prompt_tokens + self.recomputing

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prefill_target

    @property
    def kv_tokens(self) -> int:
        """The tokens whose KV it holds."""
        return self.prompt_tokens + self.generated if self.decoding else self.prefilled

    def view(self) -> RequestView:
        """As the router builds it; once its first token is out, without a TTFT target (router.dispatch). The
        traces give no client budget (`max_tokens`): the true length is told only as a prediction."""
        return RequestView(
            self.request_id,
            self.model,
            prompt_tokens=self.prompt_tokens,
            arrival=self.arrival,
            deadline=float("inf"),
            predicted_tokens=self.predicted_tokens,
            ttft_slo_s=self.ttft_slo_s if self.first_token_at is None else None,
            tpot_slo_s=self.tpot_slo_s,
            priority=self.priority,
            prefix_hashes=self.prefix_hashes,
        )

    @property
    def max_tokens(self) -> int:
        """Its output budget: the simulator generates exactly `output_tokens`."""
        return self.output_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot_s(self) -> float | None:
        if self.finished_at is None or self.first_token_at is None or self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)


@dataclass(frozen=True)
class PrefixCache:
    """Where an engine finds prompt blocks computed before: `index` under `key` (its own id for a
    per-instance cache, one shared key for the global store)."""

    index: PrefixIndex
    key: str
    block_tokens: int
    load_token_s: float = 0.0  # to bring one cached token's KV in (0: already in device memory)


PREEMPTION_MODES = ("recompute", "swap", "auto")
VICTIMS = ("last", "fairness")
STEP_KINDS = ("prefill", "decode")  # the heavier first


@dataclass(frozen=True)
class Preemption:
    """How an engine frees KV blocks when its decoding requests outgrow them (vLLM's preemption, with
    AdaptiveLLM's choices). `mode`: the victim's KV is dropped and computed again ("recompute", vLLM's
    default), copied to `cpu_blocks` of CPU memory and back ("swap", vLLM V0's swap space), or whichever
    `llmesh.policies.preemption.swap_or_recompute` finds cheaper for it ("auto", AdaptiveLLM); a swap that
    the CPU space cannot hold recomputes instead (AdaptiveLLM's capacity check; vLLM V0 would abort the
    request). `victim`: "last", vLLM's, the request admitted last; "fairness", AdaptiveLLM's, the lowest
    fairness priority (`llmesh.policies.queueing.fairness`: time in the system over predicted length)."""

    mode: Literal["recompute", "swap", "auto"] = "recompute"
    cpu_blocks: int = 0
    swap_block_s: float = 0.0  # one block's KV copied between device and CPU memory, one way
    victim: Literal["last", "fairness"] = "last"

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES or self.victim not in VICTIMS:
            raise ValueError(f"preemption: mode one of {PREEMPTION_MODES}, victim one of {VICTIMS}")
        if self.mode != "recompute" and self.swap_block_s <= 0:
            raise ValueError("preemption: swapping needs swap_block_s > 0")


@dataclass(eq=False)
class SimEngine:
    worker_id: str
    profile: EngineProfile
    role: str = "decode"  # "prefill": requests leave after their first token
    cache: PrefixCache | None = None
    model: str = "sim"  # the model it serves
    waiting: list[SimRequest] = field(default_factory=list)  # dispatched here, not yet in the batch
    running: list[SimRequest] = field(default_factory=list)  # in the batch (prefilling or decoding)
    busy_until: float | None = None  # end of the step in progress (None: idle)
    _load_s: float = 0.0  # cached KV to bring in during the next step
    steps: int = 0  # finished so far
    view_cache: tuple | None = None  # the simulated heartbeat, and the state it shows (sim.cluster)
    # the KV blocks it may hold when it shares a device's memory with other models' engines (sim.prism);
    # None: its profile's own `kv_blocks`
    kv_limit: Callable[[SimEngine], int] | None = None
    _reserved: tuple[tuple[int, int, int], int] = ((-1, -1, -1), 0)  # (steps, batch, incoming) -> reserved blocks
    preemption: Preemption | None = None  # None: no preemption (see the module's docstring)
    cpu_blocks_used: int = 0
    incoming: list[SimRequest] = field(default_factory=list)  # migrating here: their blocks reserved (sim.cluster)
    # engines sharing this one's device (a CPU host's cores): while any of them is mid-step when a step starts,
    # the step takes the times of `shared_profiles[kind]`, kind that of the heaviest such step ("prefill": it
    # computes prompt tokens; "decode": it only decodes), measured beside such a neighbour (`calibrate`)
    shared_profiles: Mapping[str, EngineProfile] = field(default_factory=dict)
    neighbours: tuple[SimEngine, ...] = ()
    step_kind: str | None = None  # of the step in progress: "prefill" or "decode" (None: idle)
    _timing: EngineProfile | None = None  # the profile timing the step in progress
    switchable: bool = False  # built with both roles: placement may switch it (sim.cluster.RoleSwitching)

    @property
    def requests(self) -> list[SimRequest]:
        return self.running + self.waiting + self.incoming

    def blocks_used(self) -> int:
        return sum(kv_blocks(r.kv_tokens, self.profile.block_size) for r in self.running)

    def kv_block_limit(self) -> int:
        return self.kv_limit(self) if self.kv_limit is not None else self.profile.kv_blocks

    def reserved_blocks(self) -> int:
        """The blocks its batch holds: every admitted prompt's, and what they generated (the batch
        changes only by admission, which grows it, and by a step, which counts itself)."""
        state = (self.steps, len(self.running), len(self.incoming))
        if self._reserved[0] != state:
            self._reserved = (
                state,
                sum(
                    kv_blocks(r.prompt_tokens + r.generated, self.profile.block_size)
                    for r in self.running + self.incoming
                ),
            )
        return self._reserved[1]

    def _admit(self, now: float) -> None:
        """Move waiting requests into the batch while sequences and KV blocks allow (in order)."""
        p = self.profile
        reserved = self.reserved_blocks()
        limit = self.kv_block_limit()
        while self.waiting and len(self.running) < p.max_seqs:
            r = self.waiting[0]
            need = kv_blocks(r.prompt_tokens + max(r.generated, 1), p.block_size)
            if self.preemption is not None and need > limit:  # larger than its whole KV space: never admitted
                self.waiting.pop(0).refused = True
                continue
            if reserved + need > limit:
                break
            reserved += need
            self.waiting.pop(0)
            if r.preempted_at is not None:
                r.requeued_s += now - r.preempted_at
                r.preempted_at = None
            if r.swapped_blocks:  # back from CPU memory, copied in during this step
                copy_s = r.swapped_blocks * self.preemption.swap_block_s  # type: ignore[union-attr]
                self._load_s += copy_s
                r.preempted_s += copy_s
                self.cpu_blocks_used -= r.swapped_blocks
                r.swapped_blocks = 0
            elif self.cache is not None and r.prefilled == 0 and r.prefix_hashes:
                c = self.cache
                r.cached_tokens = min(c.index.matched(c.key, r.prefix_hashes) * c.block_tokens, r.prompt_tokens - 1)
                r.prefilled = r.cached_tokens
                self._load_s += r.cached_tokens * c.load_token_s
            self.running.append(r)

    def _make_room(self, now: float) -> bool:
        """Preempt until the decoding requests' next tokens fit their KV space; whether any was."""
        p, limit = self.profile, self.kv_block_limit()
        preempted = False
        while self.running:
            need = sum(kv_blocks(r.prompt_tokens + r.generated + r.decoding, p.block_size) for r in self.running)
            if need <= limit:
                break
            self._preempt(self._victim(now), now)
            preempted = True
        return preempted

    def _victim(self, now: float) -> SimRequest:
        if self.preemption.victim == "last":  # type: ignore[union-attr]
            return self.running[-1]
        key = fairness().key
        return max(self.running, key=lambda r: (key(now, r.view()), r.arrival, r.request_id))

    def _preempt(self, r: SimRequest, now: float) -> None:
        """`r` leaves the batch for the front of the queue, its KV swapped out or dropped."""
        pre, p = self.preemption, self.profile
        assert pre is not None
        blocks = kv_blocks(r.kv_tokens, p.block_size)
        choice: Choice = "recompute" if pre.mode == "recompute" else "swap"
        if pre.mode == "auto":
            tokens = max(r.kv_tokens, 1)
            recompute_rate = tokens / max(p.prefill_s(tokens) - p.base_s, 1e-12)  # alone, without the step's fixed cost
            # "bytes" in blocks: out now and in when it resumes, at 1 / swap_block_s blocks a second
            choice = swap_or_recompute(tokens, 2 * blocks, 1 / pre.swap_block_s, recompute_rate).choice
        if choice == "swap" and self.cpu_blocks_used + blocks > pre.cpu_blocks:
            choice = "recompute"
        self.running.remove(r)
        if choice == "swap":
            r.swapped_blocks = blocks
            self.cpu_blocks_used += blocks
            self._load_s += blocks * pre.swap_block_s
            r.preempted_s += blocks * pre.swap_block_s
        else:
            r.recomputing = r.generated if r.decoding else r.recomputing
            r.preempted_s += p.prefill_s(r.kv_tokens) - p.base_s
            r.prefilled = 0
        r.preemptions += 1
        r.swaps += choice == "swap"
        r.preempted_at = now
        self.waiting.insert(0, r)

    def start_step(self, now: float) -> float | None:
        """Plan the next step from `now`; its end time, or None when there is no work."""
        # vLLM admits none in a step that preempted, unless the batch is empty
        if self.preemption is None or not self._make_room(now) or not self.running:
            self._admit(now)
        if not self.running:
            self.busy_until = None
            return None
        budget = self.profile.max_batched_tokens
        self._plan: list[tuple[SimRequest, int]] = []
        decoding = [r for r in self.running if r.decoding and r.paused_until <= now]
        prefill_tokens = pairs = 0
        for r in self.running:
            left = r.prefill_target - r.prefilled
            if left and budget:
                chunk = min(left, budget)
                budget -= chunk
                prefill_tokens += chunk
                pairs += attention_pairs(r.prefilled, chunk)
                self._plan.append((r, chunk))
        if self.profile.prefill_first and self._plan:
            decoding = []
        context = sum(r.prompt_tokens + r.generated for r in decoding)
        self._decoding = decoding
        if not decoding and not self._plan:  # all it holds wait for their migrated KV: idle until the first has it
            self.busy_until, self.step_kind = min(r.paused_until for r in self.running), None
            return self.busy_until
        self.step_kind = "prefill" if self._plan else "decode"
        beside = {n.step_kind for n in self.neighbours if n.busy_until is not None}  # None: not computing
        kind = next((k for k in STEP_KINDS if k in beside), None)
        self._timing = self.shared_profiles.get(kind, self.profile) if kind else self.profile
        self.busy_until = now + self._timing.step_s(prefill_tokens, len(decoding), context, pairs) + self._load_s
        self._load_s = 0.0
        return self.busy_until

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the planned step's work at its end `now`; the requests that leave (finished, or a
        prefill engine's with their first token out)."""
        out = now + (self._timing or self.profile).first_token_s  # when what this step sampled reaches the client
        for r, chunk in self._plan:
            r.prefilled += chunk
            if not r.decoding:
                continue
            r.token_out(out)
            if r.first_token_at is not None:  # a recompute done: its last chunk samples the next token
                r.generated += 1
                continue
            r.generated, r.first_token_at = 1, out  # the last chunk samples the first token
            if self.cache is not None and r.prefix_hashes:
                self.cache.index.record(self.cache.key, r.prefix_hashes)
        for r in self._decoding:
            r.generated += 1
            r.token_out(out)
        leaving = [
            r
            for r in self.running
            if r.first_token_at is not None and (self.role == "prefill" or r.generated >= r.output_tokens)
        ]
        for r in leaving:
            if r.generated >= r.output_tokens:
                r.finished_at = out
            self.running.remove(r)
        self.busy_until = None
        self.steps += 1
        return leaving
