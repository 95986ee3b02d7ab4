"""A model of one engine: continuous batching with chunked prefill, as vLLM's scheduler runs it.

Each step computes up to `max_batched_tokens` of prompt (oldest first, a prompt may span steps)
plus one token for every request already decoding. Its time is affine in that work:
`step_s = base_s + prefill_token_s · prompt tokens + decode_seq_s · decoding requests +
context_token_s · their context`. A prompt's first token comes at the end of the step that
computes its last chunk. KV memory is counted in blocks; a request is admitted to the batch
only when its prompt's blocks are free, and holds its blocks until it finishes.

Roles, as in the mesh: a "prefill" engine hands a request on once its first token is out; a
"decode" engine takes requests whose KV arrived (their prompt needs no compute) or, as a
monolithic engine, whole requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmesh.policies.core import kv_blocks


@dataclass(frozen=True)
class EngineProfile:
    name: str
    base_s: float  # fixed cost of a step
    prefill_token_s: float  # per prompt token computed in the step
    decode_seq_s: float  # per request decoding in the step
    context_token_s: float = 0.0  # per token of context of the decoding requests (attention)
    max_batched_tokens: int = 2048
    max_seqs: int = 256
    kv_blocks: int = 4096
    block_size: int = 16
    kv_transfer_token_s: float = 0.0  # prefill to decode, per prompt token, beyond what overlaps the prefill
    source: str = ""  # where the numbers come from

    def step_s(self, prefill_tokens: int, decoding: int, context_tokens: int) -> float:
        return (self.base_s + self.prefill_token_s * prefill_tokens + self.decode_seq_s * decoding
                + self.context_token_s * context_tokens)


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
    # filled in as it runs
    prefilled: int = 0
    generated: int = 0
    dispatched_at: float | None = None
    worker_id: str | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    refused: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    @property
    def tpot_s(self) -> float | None:
        if self.finished_at is None or self.first_token_at is None or self.output_tokens < 2:
            return None
        return (self.finished_at - self.first_token_at) / (self.output_tokens - 1)


@dataclass(eq=False)
class SimEngine:
    worker_id: str
    profile: EngineProfile
    role: str = "decode"  # "prefill": requests leave after their first token
    waiting: list[SimRequest] = field(default_factory=list)  # dispatched here, not yet in the batch
    running: list[SimRequest] = field(default_factory=list)  # in the batch (prefilling or decoding)
    busy_until: float | None = None  # end of the step in progress (None: idle)

    @property
    def requests(self) -> list[SimRequest]:
        return self.running + self.waiting

    def blocks_used(self) -> int:
        return sum(kv_blocks(r.prefilled + r.generated, self.profile.block_size) for r in self.running)

    def _admit(self) -> None:
        """Move waiting requests into the batch while sequences and KV blocks allow (in order)."""
        p = self.profile
        reserved = sum(kv_blocks(r.prompt_tokens + r.generated, p.block_size) for r in self.running)
        while self.waiting and len(self.running) < p.max_seqs:
            need = kv_blocks(self.waiting[0].prompt_tokens + 1, p.block_size)
            if reserved + need > p.kv_blocks:
                break
            reserved += need
            self.running.append(self.waiting.pop(0))

    def start_step(self, now: float) -> float | None:
        """Plan the next step from `now`; its end time, or None when there is no work."""
        self._admit()
        if not self.running:
            self.busy_until = None
            return None
        budget = self.profile.max_batched_tokens
        self._plan: list[tuple[SimRequest, int]] = []
        decoding = [r for r in self.running if r.prefilled == r.prompt_tokens]
        prefill_tokens = 0
        for r in self.running:
            left = r.prompt_tokens - r.prefilled
            if left and budget:
                chunk = min(left, budget)
                budget -= chunk
                prefill_tokens += chunk
                self._plan.append((r, chunk))
        context = sum(r.prompt_tokens + r.generated for r in decoding)
        self._decoding = decoding
        self.busy_until = now + self.profile.step_s(prefill_tokens, len(decoding), context)
        return self.busy_until

    def finish_step(self, now: float) -> list[SimRequest]:
        """Apply the planned step's work at its end `now`; the requests that leave (finished, or a
        prefill engine's with their first token out)."""
        for r, chunk in self._plan:
            r.prefilled += chunk
            if r.prefilled == r.prompt_tokens:  # the last chunk samples the first token
                r.generated, r.first_token_at = 1, now
        for r in self._decoding:
            r.generated += 1
        leaving = [r for r in self.running if r.first_token_at is not None
                   and (self.role == "prefill" or r.generated >= r.output_tokens)]
        for r in leaving:
            if r.generated >= r.output_tokens:
                r.finished_at = now
            self.running.remove(r)
        self.busy_until = None
        return leaving
