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

Roles, as in the mesh: a "prefill" engine hands a request on once its first token is out; a
"decode" engine takes requests whose KV arrived (their prompt needs no compute) or, as a
monolithic engine, whole requests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmesh.policies.core import kv_blocks
from llmesh.policies.prefix import PrefixIndex


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
    _reserved: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (steps, batch size) -> reserved blocks

    @property
    def requests(self) -> list[SimRequest]:
        return self.running + self.waiting

    def blocks_used(self) -> int:
        return sum(kv_blocks(r.prefilled + r.generated, self.profile.block_size) for r in self.running)

    def reserved_blocks(self) -> int:
        """The blocks its batch holds: every admitted prompt's, and what they generated (the batch
        changes only by admission, which grows it, and by a step, which counts itself)."""
        state = (self.steps, len(self.running))
        if self._reserved[0] != state:
            self._reserved = (
                state,
                sum(kv_blocks(r.prompt_tokens + r.generated, self.profile.block_size) for r in self.running),
            )
        return self._reserved[1]

    def _admit(self) -> None:
        """Move waiting requests into the batch while sequences and KV blocks allow (in order)."""
        p = self.profile
        reserved = self.reserved_blocks()
        limit = self.kv_limit(self) if self.kv_limit is not None else p.kv_blocks
        while self.waiting and len(self.running) < p.max_seqs:
            need = kv_blocks(self.waiting[0].prompt_tokens + 1, p.block_size)
            if reserved + need > limit:
                break
            reserved += need
            r = self.waiting.pop(0)
            if self.cache is not None and r.prefilled == 0 and r.prefix_hashes:
                c = self.cache
                r.cached_tokens = min(c.index.matched(c.key, r.prefix_hashes) * c.block_tokens, r.prompt_tokens - 1)
                r.prefilled = r.cached_tokens
                self._load_s += r.cached_tokens * c.load_token_s
            self.running.append(r)

    def start_step(self, now: float) -> float | None:
        """Plan the next step from `now`; its end time, or None when there is no work."""
        self._admit()
        if not self.running:
            self.busy_until = None
            return None
        budget = self.profile.max_batched_tokens
        self._plan: list[tuple[SimRequest, int]] = []
        decoding = [r for r in self.running if r.prefilled == r.prompt_tokens]
        prefill_tokens = pairs = 0
        for r in self.running:
            left = r.prompt_tokens - r.prefilled
            if left and budget:
                chunk = min(left, budget)
                budget -= chunk
                prefill_tokens += chunk
                pairs += attention_pairs(r.prefilled, chunk)
                self._plan.append((r, chunk))
        context = sum(r.prompt_tokens + r.generated for r in decoding)
        self._decoding = decoding
        self.busy_until = now + self.profile.step_s(prefill_tokens, len(decoding), context, pairs) + self._load_s
        self._load_s = 0.0
        return self.busy_until

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the planned step's work at its end `now`; the requests that leave (finished, or a
        prefill engine's with their first token out)."""
        for r, chunk in self._plan:
            r.prefilled += chunk
            if r.prefilled == r.prompt_tokens:  # the last chunk samples the first token
                r.generated, r.first_token_at = 1, now
                if self.cache is not None and r.prefix_hashes:
                    self.cache.index.record(self.cache.key, r.prefix_hashes)
        for r in self._decoding:
            r.generated += 1
        leaving = [
            r
            for r in self.running
            if r.first_token_at is not None and (self.role == "prefill" or r.generated >= r.output_tokens)
        ]
        for r in leaving:
            if r.generated >= r.output_tokens:
                r.finished_at = now
            self.running.remove(r)
        self.busy_until = None
        self.steps += 1
        return leaving
