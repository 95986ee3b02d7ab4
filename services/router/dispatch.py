"""One request through the mesh, run by the HTTP layer (llmesh_router.serving) as `Dispatcher.generate`, which
hands each delta shown to the client to the request's sink as it comes. A request's state is its `RequestRun`'s;
what it holds of the workers, its `Reservation`'s (llmesh_router.scheduler), given back when a try ends. Its
stages, each a method here:

1. admitted: a length tag if a policy reads one (llmesh_router.lengths), then a prefill worker and a
   decode slot from the scheduler, waiting in its queue while none has room (`_admit`);
2. prefill: on the prefill worker, which returns the first token and where the KV lies; or the whole
   request on a decode worker when the prefill queue would answer later, or always for a model served
   aggregated (`ServedModel.disaggregated`; `_prefill_then_decode`);
3. decode: a decode worker streams the rest (`_decode`, `_relay`);
4. resumed or migrated: a decode worker that dies, refuses or hands the request over (live
   migration) is followed by another, from the KV in the store (`_decode`, `_resume_site`);
5. done: a finish reason, an error, the deadline, or the client gone (the worker is told to abort).

Which failures are tried again, and how often, is one table (`PLACE_AGAIN`, `RESUME`; `_retry`).

Every stage is bounded by the request's deadline and by the chosen worker's liveness (a
worker that stops heart-beating fails the request at once, not at the deadline).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from opentelemetry import context, trace

from llmesh.policies import RequestView
from llmesh.policies.core import Role
from llmesh.policies.disagg import StreamProgress
from llmesh.wire import telemetry
from llmesh.wire.bus import Bus
from llmesh.wire.errors import (
    AtCapacity,
    InvalidRequest,
    MeshError,
    NoResponders,
    ServiceUnavailable,
    StreamInterrupted,
    Timeout,
    WorkerLost,
)
from llmesh.wire.lifecycle import cancel_and_wait
from llmesh.wire.messages import (
    AbortRequest,
    Ack,
    ChatMessage,
    DecodeRequest,
    DetokenizeTokens,
    KvHandle,
    LengthPrediction,
    LoraAdapter,
    LoraCommand,
    M,
    Message,
    Migrated,
    PrefillRequest,
    PrefillResult,
    SamplingOptions,
    Subjects,
    TokenDelta,
    TokenizePrompt,
    WorkerInfo,
)

from .lengths import LengthTagger
from .metrics import RouterMetrics
from .scheduler import Leg, Reservation, Scheduler
from .stops import OutputEnd

log = logging.getLogger(__name__)
T = TypeVar("T")
CHAT_TEMPLATE_CHARS = 16  # what a chat template adds per message, roughly, before tokenization
PREFIX_BLOCK_CHARS = 256  # prompt text per block of a request's prefix hashes (~64 tokens; for prefix affinity)
MAX_FAILOVERS = 3  # times one request's decode resumes after its worker died (a refusal as full is not counted)
# after this router's bus reconnected, how long to give the workers' connections to come back too
# (nats-py retries every 0.5 s) before sending a request again
RECONNECT_GRACE_S = 1.0
MAX_REDISPATCHES = 2  # times a request that reached no worker (gone, not yet known dead) is placed again
# times a request a worker refused as full before its first token is placed again (each time it waits in the
# router's queue until a slot frees: the refusal marks that worker full in this router's view); past its first
# token only its deadline bounds the tries
MAX_REFUSALS = 8
TOKENIZER_TIMEOUT_S = 10.0  # a worker's answer to /tokenize or /detokenize
TOKENIZER_TRIES = 2  # workers asked in turn, where one is gone (not yet known dead) or does not answer
ADAPTER_TIMEOUT_S = 120.0  # a worker's engine loading a LoRA adapter (a hub name's download included)


@dataclass(frozen=True)
class _Retry:
    """How a request goes on after a failure: placed again from the start (nothing streamed yet) or its decode
    resumed on another worker from its KV (`resumes`), at most `tries` times (None: until its deadline)."""

    label: str  # its span event and metric label
    tries: int | None
    pause_s: float = 0.0  # a reconnection's grace before trying again

    @property
    def refused(self) -> bool:
        return self.label == "refused"


# The one table of retries, by failure (the most specific class listed wins). Before the first token:
PLACE_AGAIN: dict[type[MeshError], _Retry] = {
    AtCapacity: _Retry("refused", MAX_REFUSALS),  # the worker was fuller than this router knew: wait for room again
    NoResponders: _Retry("redispatched", MAX_REDISPATCHES),  # it died since its last heartbeat
    StreamInterrupted: _Retry("redispatched", MAX_REDISPATCHES, RECONNECT_GRACE_S),
}
# Past it (its client has a 200 and tokens): a refusal is no failure (the worker never took the leg), so it waits
# for room, each try a heartbeat or a request's end; a worker lost is failed over.
RESUME: dict[type[MeshError], _Retry] = {
    AtCapacity: _Retry("refused", None),
    StreamInterrupted: _Retry("failover", MAX_FAILOVERS, RECONNECT_GRACE_S),  # (the same worker goes on)
    WorkerLost: _Retry("failover", MAX_FAILOVERS),
    ServiceUnavailable: _Retry("failover", MAX_FAILOVERS),
}


class RequestRun:
    """One request through the mesh (one choice of a client's request), and the one owner of its state: what it
    asks (`gen`: ids, sampling, deadline), its length prediction (and the one pending), its output so far and the
    stop filter that shows it, where its KV lies, what it holds of the workers (`held`), its progress as its client
    sees it (a Stream, for the stall bound), where its deltas go (`sink`) and the retries it took. It builds its own
    prefill and decode messages."""

    held: Reservation  # (a try's: see Dispatcher.generate)

    def __init__(self, gen: Generation, predicted: LengthPrediction | None, sink: Sink):
        self.gen, self.predicted, self.sink = gen, predicted, sink
        self.predicting: asyncio.Task | None = None  # a prediction asked beside the prefill (LengthTagger.beside)
        self.ends = OutputEnd(gen.sampling)
        self.prompt_token_ids: list[int] = []  # as its worker tokenized it (from the prefill, or the first delta)
        self.output_token_ids: list[int] = []  # streamed to the client so far
        self.max_tokens = gen.sampling.max_tokens or 0  # 0: the rest of the context, until a worker resolves it
        self.fingerprint = ""  # the KV layout of the workers that hold its KV
        self.kv: KvHandle | None = None  # where the KV of all but the last token lies; None: look the store up
        self.kv_outputs = 1  # the output tokens `kv` covers (with the last one)
        self.first_at = self.last_at = 0.0  # when its first and latest tokens came (monotonic)
        self.tries: Counter[str] = Counter()  # retries by label (`_Retry`)

    @property
    def started(self) -> bool:
        """Whether its client has tokens (a failure is then resumed, not placed again)."""
        return bool(self.output_token_ids)

    @property
    def tokens(self) -> int:
        return len(self.output_token_ids)

    def snapshot(self, now: float) -> StreamProgress:
        return StreamProgress(now - self.first_at, self.tokens, max(self.max_tokens - self.tokens, 0))

    def prefilled(self, result: PrefillResult, first: TokenDelta) -> None:
        """Its prompt computed by a prefill worker, which made its `first` token (as shown) and stored its KV."""
        self.prompt_token_ids, self.max_tokens = list(result.prompt_token_ids), result.max_tokens
        self.fingerprint, self.kv = result.fingerprint, result.kv
        self.streamed(first.model_copy(update={"prompt_token_ids": result.prompt_token_ids}))  # (read by parsers)

    def streamed(self, delta: TokenDelta, context_len: int = 0) -> None:
        """`delta` shown to the client, handed to its sink (the first of a whole request on a decode worker brings
        the prompt as that worker tokenized it, and `context_len` resolves its max_tokens)."""
        self.last_at = time.monotonic()
        if not self.output_token_ids:
            self.first_at = self.last_at
        if delta.prompt_token_ids is not None and not self.prompt_token_ids:
            self.prompt_token_ids = list(delta.prompt_token_ids)
            self.max_tokens = self.max_tokens or context_len - len(self.prompt_token_ids)
        self.output_token_ids += delta.token_ids
        self.sink(delta)

    def prefill_request(self) -> PrefillRequest:
        gen = self.gen
        return PrefillRequest(
            request_id=gen.request_id,
            model=gen.model,
            prompt=gen.prompt,
            prompt_token_ids=gen.prompt_token_ids,
            messages=gen.messages,
            tools=gen.tools,
            template_kwargs=gen.template_kwargs,
            add_special_tokens=gen.add_special_tokens,
            truncate_prompt_tokens=gen.truncate_prompt_tokens,
            truncation_side=gen.truncation_side,
            sampling=gen.sampling,
            deadline=gen.deadline,
            predicted_length=self.predicted,
            cache_salt=gen.cache_salt,
            priority=gen.priority,
            lora=gen.lora,
        )

    def decode_request(self, migration_id: str | None = None, recompute: bool = False) -> DecodeRequest:
        gen = self.gen
        return DecodeRequest(
            request_id=gen.request_id,
            model=gen.model,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=self.output_token_ids,
            fingerprint=self.fingerprint,
            sampling=gen.sampling.model_copy(update={"max_tokens": self.max_tokens}),
            kv=self.kv,
            deadline=gen.deadline,
            predicted_length=self.predicted,
            cache_salt=gen.cache_salt,
            priority=gen.priority,
            migration_id=migration_id,
            recompute=recompute,
            lora=gen.lora,
        )

    def handed_over(self, handed: Migrated) -> None:
        """A live migration moved it: its KV is where the hand-over says."""
        self.kv, self.kv_outputs = handed.kv, self.tokens

    def lost_leg(self, leg_tokens: int) -> None:
        """Its worker failed after it streamed from token `leg_tokens`: a handle no longer matching the output is
        dropped (the next worker looks the store up)."""
        if self.tokens > leg_tokens or self.kv_outputs != self.tokens:
            self.kv = None

    def stop_predicting(self) -> None:
        if self.predicting is not None and not self.predicting.done():
            self.predicting.cancel()


Sink = Callable[[TokenDelta], None]  # where a request's deltas go as they come (called on the bus's read: no await)


@dataclass(frozen=True)
class Generation:
    request_id: str
    model: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[ChatMessage] | None
    sampling: SamplingOptions  # max_tokens None: the rest of the context
    deadline: float  # wall-clock (time.time())
    tools: list[dict[str, Any]] | None = None  # a chat's, for its template
    template_kwargs: dict[str, Any] | None = None  # a chat's other template variables
    add_special_tokens: bool | None = None  # None: the endpoint's default
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    cache_salt: str | None = None
    lora: LoraAdapter | None = None  # the LoRA adapter it names (`model` is then the adapter's base model)
    priority: int = 0  # vLLM's convention: lower is more urgent
    ttft_slo_s: float | None = None  # None: the router's default
    tpot_slo_s: float | None = None
    arrival: float = field(default_factory=time.monotonic)

    def prefix_hashes(self) -> tuple[int, ...]:
        """Chained hashes of the prompt's leading whole blocks of text (token ids: of 64 ids), so equal
        hashes mean equal prefixes (within one LoRA adapter, as KV is shared), as vllm-router's cache-aware
        policy matches prompt text."""
        units: str | tuple[int, ...]
        if self.prompt_token_ids is not None:
            units, size = tuple(self.prompt_token_ids), PREFIX_BLOCK_CHARS // 4
        elif self.messages is not None:
            units, size = "".join(f"<{m.role}>{m.content}" for m in self.messages), PREFIX_BLOCK_CHARS
        else:
            units, size = self.prompt or "", PREFIX_BLOCK_CHARS
        hashes, h = [], hash(self.lora.name) if self.lora else 0
        for start in range(0, len(units) - size + 1, size):
            h = hash((h, units[start : start + size]))
            hashes.append(h)
        return tuple(hashes)

    @property
    def length_prompt(self) -> str | None:
        """What the length predictor reads: the prompt text, or a chat's user turns (None for token ids)."""
        if self.messages is not None:
            return "\n".join(m.content for m in self.messages if m.role == "user")
        return self.prompt


class Dispatcher:
    """Requests through the mesh, each in its own `generate`: the flow. What is believed about the
    workers, and the choices among them, are the scheduler's; the length tags are the tagger's."""

    def __init__(self, bus: Bus, scheduler: Scheduler, lengths: LengthTagger, metrics: RouterMetrics):
        self.bus, self.scheduler, self.lengths, self.metrics = bus, scheduler, lengths, metrics
        self.registry = scheduler.registry
        bus.reconnected.append(self.registry.interrupt_all)
        self._tokens_per_char = 0.25
        self._tracer = telemetry.tracer("llmesh.router")

    async def ask_tokenizer(self, query: TokenizePrompt | DetokenizeTokens, expected: type[M]) -> M:
        """A worker of the query's model answers it with its tokenizer and chat template: an active one
        first, the least busy first; one that is gone is passed over."""
        self.registry.check_known(query.model)
        workers = sorted(
            (w for w in self.registry.live() if w.model == query.model), key=lambda w: (w.state != "active", w.running)
        )
        if not workers:
            raise ServiceUnavailable(f"no worker serves {query.model!r} now")
        for worker in workers[:TOKENIZER_TRIES]:
            try:
                reply, _ = await self.bus.request(
                    Subjects.tokenizer(worker.worker_id), query, expected, timeout=TOKENIZER_TIMEOUT_S
                )
                return reply
            except (NoResponders, Timeout) as exc:
                log.warning("%s did not answer a tokenizer query (%s)", worker.worker_id, exc.message)
                failure = exc
        raise failure

    async def command_adapter(self, model: str, command: LoraCommand) -> None:
        """Have every live worker of `model` load or unload an adapter: all at once, each answering when its
        engine has (an error of vLLM's refusing the adapter raised as it is). A load some refused is undone on
        those that took it."""
        workers = [w.worker_id for w in self.registry.live() if w.model == model]
        if not workers:
            raise ServiceUnavailable(f"no worker serves {model!r} now")
        answers = await asyncio.gather(
            *(self.bus.request(Subjects.lora(worker), command, Ack, timeout=ADAPTER_TIMEOUT_S) for worker in workers),
            return_exceptions=True,
        )
        failed = [answer for answer in answers if isinstance(answer, BaseException)]
        if not failed:
            return
        if command.op == "load":
            undo = command.model_copy(update={"op": "unload"})
            took = [w for w, answer in zip(workers, answers) if not isinstance(answer, BaseException)]
            await asyncio.gather(
                *(self.bus.request(Subjects.lora(w), undo, Ack, timeout=ADAPTER_TIMEOUT_S) for w in took),
                return_exceptions=True,
            )
        refused = next((e for e in failed if isinstance(e, InvalidRequest)), failed[0])
        raise refused

    def estimate_prompt_tokens(self, gen: Generation) -> int:
        """The prompt's length in tokens before a worker tokenizes it (from its characters, at the
        ratio the workers' tokenizations have shown so far)."""
        if gen.prompt_token_ids is not None:
            return len(gen.prompt_token_ids)
        if gen.messages is not None:
            chars = sum(len(m.content) for m in gen.messages) + CHAT_TEMPLATE_CHARS * len(gen.messages)
            chars += len(json.dumps(gen.tools)) if gen.tools else 0  # (as templates list them, roughly)
        else:
            chars = len(gen.prompt or "")
        return max(1, round(chars * self._tokens_per_char))

    def _learn_tokens_per_char(self, gen: Generation, tokens: int) -> None:
        if gen.prompt is not None and gen.prompt_token_ids is None and gen.prompt:
            self._tokens_per_char += 0.1 * (tokens / len(gen.prompt) - self._tokens_per_char)

    def _request_view(self, run: RequestRun) -> RequestView:
        """The request as the dispatch policy sees it (its deadline on the monotonic clock); past its first token
        a queue policy weighs only its overall deadline."""
        gen, predicted, now = run.gen, run.predicted, time.monotonic()
        if predicted is not None and not predicted.informative:
            predicted = None  # the predictor says it knows no more than a constant: policies act as without one
        return RequestView(
            request_id=gen.request_id,
            model=gen.model,
            prompt_tokens=len(run.prompt_token_ids) or self.estimate_prompt_tokens(gen),
            arrival=gen.arrival,
            deadline=now + gen.deadline - time.time(),
            max_tokens=run.max_tokens or gen.sampling.max_tokens,
            predicted_tokens=predicted.expected_tokens if predicted else None,
            prediction_confidence=predicted.confidence if predicted else 0.0,
            priority=gen.priority,
            ttft_slo_s=None if run.started else gen.ttft_slo_s,
            tpot_slo_s=gen.tpot_slo_s or self.scheduler.tpot_slo_s,
            prefix_hashes=gen.prefix_hashes() if self.scheduler.policy.needs_prefix else (),
            adapter=gen.lora.name if gen.lora else None,
        )

    async def generate(self, gen: Generation, parent: context.Context, sink: Sink) -> None:
        """Run `gen` to its end, each delta handed to `sink` as it comes; spans are children of `parent`. A request
        that failed before anything was streamed is placed again (`PLACE_AGAIN`); past its first token, its decode
        resumes (`RESUME`, `_decode`). Cancelled, it aborts the request in its worker."""
        self.scheduler.arrived(gen.model)
        run = RequestRun(gen, await self.lengths.before_dispatch(gen, parent), sink)
        while True:
            with self.scheduler.reservation(gen.model) as run.held:  # each try holds its own
                try:
                    await self._prefill_then_decode(run, parent)
                    return
                except MeshError as exc:
                    if run.started or (retry := self._retry(run, exc, parent)) is None:
                        raise
                finally:
                    run.stop_predicting()
            await asyncio.sleep(retry.pause_s)

    def _retry(self, run: RequestRun, exc: MeshError, parent: context.Context, worker_id: str = "") -> _Retry | None:
        """Whether and how `run` goes on after `exc`, by the table of its stage (PLACE_AGAIN, RESUME), counted and
        told; None: `exc` is its client's answer."""
        table = RESUME if run.started else PLACE_AGAIN
        retry = next((table[kind] for kind in type(exc).__mro__ if kind in table), None)
        if retry is None or (retry.tries is not None and run.tries[retry.label] >= retry.tries):
            return None
        if run.started and time.time() >= run.gen.deadline:
            return None
        run.tries[retry.label] += 1
        if run.started:
            self.metrics.resumes.labels(retry.label).inc()
            trace.get_current_span(parent).add_event(
                f"decode {retry.label}", {"worker.id": worker_id, "error": exc.code}
            )
            went_on = f"resuming it after {run.tokens} tokens"
        else:
            if not retry.refused:
                self.metrics.redispatches.inc()
            trace.get_current_span(parent).add_event(retry.label, {"error": exc.message})
            went_on = "placing it again"
        level = logging.INFO if retry.refused else logging.WARNING
        log.log(level, "request %s: %s; %s", run.gen.request_id, exc.message, went_on)
        return retry

    async def _prefill_then_decode(self, run: RequestRun, parent: context.Context) -> None:
        gen, held = run.gen, run.held
        view = self._request_view(run)
        local: WorkerInfo | None = None  # a decode worker running it whole
        if "prefill" not in self.registry.roles(gen.model):  # an aggregated model: its decode workers run it whole
            local = await self._admit(held, "decode", view, parent, generates=True)
        else:
            prefill = await self._admit(held, "prefill", view, parent, claim_decode=gen.sampling.max_tokens != 1)
            run.predicting = self.lengths.beside(gen, parent)
            if (local := held.prefill_locally(view, prefill)) is not None:
                self._count_adapter(view, "decode", local, parent)
        if local is not None:  # the whole request on a decode worker: no prefill queue, no KV transfer
            self.metrics.prefill_sites.labels("decode").inc()
            run.fingerprint = local.fingerprint
            start = (Subjects.generate(local.worker_id), run.prefill_request())
            await self._decode(run, local, start, parent)
            return
        self.metrics.prefill_sites.labels("prefill").inc()
        try:
            with self._tracer.start_as_current_span(
                "router.prefill", context=parent, attributes={"worker.id": prefill.worker_id}
            ):
                started = time.monotonic()
                result, _ = await self._while_alive(
                    prefill.worker_id,
                    self.bus.request(
                        Subjects.worker("prefill", prefill.worker_id),
                        run.prefill_request(),
                        PrefillResult,
                        timeout=gen.deadline - time.time(),
                    ),
                )
                self.metrics.prefill_seconds.observe(time.monotonic() - started)
        except BaseException as exc:
            await self._after_failure(prefill.worker_id, gen.request_id, exc)
            raise
        finally:
            held.release(prefill.worker_id)
        self._learn_tokens_per_char(gen, len(result.prompt_token_ids))
        # The first token comes from the prefill: the client sees it before decode starts.
        first = run.ends.shown(result.first)
        run.prefilled(result, first)
        if first.finish_reason is not None:
            return
        if run.predicting is not None:
            run.predicted, run.predicting = self.lengths.so_far(run.predicting, parent), None
        decode = await self._admit(held, "decode", self._request_view(run), parent, fingerprint=run.fingerprint)
        await self._decode(run, decode, None, parent)

    async def _decode(
        self, run: RequestRun, worker: WorkerInfo, start: tuple[str, Message] | None, parent: context.Context
    ) -> None:
        """The request's output from `worker` (held for it), which `start` (subject, request) begins there or else
        the run's decode request, until it finishes; resumed on another decode worker after a live migration's
        hand-over (`Migrated`) or where a worker dies or refuses (`RESUME`)."""
        worker_id, context_len = worker.worker_id, worker.max_model_len
        subject, request = start or (Subjects.worker("decode", worker_id), run.decode_request())
        moved_from = None
        while True:
            leg_worker, leg_tokens = worker_id, run.tokens
            span = "router.generate" if isinstance(request, PrefillRequest) else "router.decode"
            try:
                handed = await self._relay(worker_id, subject, request, run, parent, span, context_len)
                if handed is None:
                    return
            except MeshError as exc:
                if not run.started or (retry := self._retry(run, exc, parent, worker_id)) is None:
                    raise
                run.lost_leg(leg_tokens)
                # a migration's target that failed before taking over: its source resumes; a stream cut by a
                # reconnection goes on where it was (the worker replaces the leg it still runs)
                source = moved_from if run.tokens == leg_tokens and not retry.refused else None
                if isinstance(exc, StreamInterrupted):
                    source = leg_worker
                await asyncio.sleep(retry.pause_s)
                try:
                    worker_id, moved_from = await self._resume_site(run, source, parent), None
                except Timeout:
                    raise  # its deadline passed waiting for room
                except MeshError:
                    raise exc from None  # nowhere to go on: the original failure is the news
                request = run.decode_request()
            else:
                if handed.output_tokens != run.tokens:
                    log.error(
                        "request %s: %s handed over after %d tokens but streamed %d; resuming from the store",
                        run.gen.request_id,
                        worker_id,
                        handed.output_tokens,
                        run.tokens,
                    )
                    handed = handed.model_copy(update={"kv": None})
                self.metrics.resumes.labels("migrated").inc()
                trace.get_current_span(parent).add_event(
                    "migrated", {"worker.id": worker_id, "target": handed.target, "migration.id": handed.migration_id}
                )
                run.handed_over(handed)
                moved_from, worker_id = worker_id, handed.target
                run.held.hold(worker_id)
                request = run.decode_request(migration_id=handed.migration_id, recompute=handed.kv is None)
            finally:
                run.held.release(leg_worker)
            subject = Subjects.worker("decode", worker_id)

    async def _resume_site(self, run: RequestRun, moved_from: str | None, parent: context.Context) -> str:
        """Where a decode goes on after its worker failed: the source of a migration whose target
        failed before it took over, else the dispatch policy's choice (held either way)."""
        if moved_from is not None and any(w.worker_id == moved_from for w in self.registry.live("decode")):
            run.held.hold(moved_from)
            return moved_from
        chosen = await self._admit(run.held, "decode", self._request_view(run), parent, fingerprint=run.fingerprint)
        return chosen.worker_id

    async def _admit(
        self,
        held: Reservation,
        role: Role,
        view: RequestView,
        parent: context.Context,
        fingerprint: str | None = None,
        *,
        generates: bool = False,
        claim_decode: bool = False,
    ) -> WorkerInfo:
        """A worker of `role` for the request, held by it (Reservation.admit); the choice is counted and put on
        the request's span."""
        started = time.monotonic()
        with self.metrics.queued(view.model):
            worker, queued = await held.admit(role, view, fingerprint, generates=generates, claim_decode=claim_decode)
        waited = time.monotonic() - started
        policy = self.scheduler.policy.name
        self.metrics.dispatch.labels(policy, role, "queued" if queued else "placed").inc()
        self._count_adapter(view, role, worker, parent)
        if role == "prefill" or generates:  # its first worker: what vLLM's queue time measures
            self.metrics.queue_time.labels(view.model).observe(waited)
        trace.get_current_span(parent).set_attributes(
            {
                f"dispatch.{role}.policy": policy,
                f"dispatch.{role}.worker": worker.worker_id,
                f"dispatch.{role}.queue_s": waited if queued else 0.0,
            }
        )
        return worker

    def _count_adapter(self, view: RequestView, role: Role, worker: WorkerInfo, parent: context.Context) -> None:
        """For a request with a LoRA adapter: whether the `role` worker chosen for it held the adapter loaded."""
        if view.adapter is not None:
            loaded = view.adapter in worker.loaded_adapters
            self.metrics.adapter_dispatches.labels(role, "yes" if loaded else "no").inc()
            trace.get_current_span(parent).set_attribute(f"dispatch.{role}.adapter_loaded", loaded)

    async def _relay(
        self,
        worker_id: str,
        subject: str,
        request: Message,
        run: RequestRun,
        parent: context.Context,
        span_name: str,
        context_len: int,
    ) -> Migrated | None:
        """The deltas `worker_id` streams for `request` shown to the run's client, through its stop filter, as
        they come (`ReplyStream.each`: no await between the bus's read and the client's sink), until one finishes
        or the worker hands the request over (its `Migrated` returned); meanwhile the run counts among the streams
        the worker decodes (for the stall bound). A delta that does not follow the run's tokens so far (NATS lost
        one before it, in a reconnection) ends the relay with StreamInterrupted, before anything past the gap is
        shown.

        The worker is told to abort if the client leaves, the deadline passes, a stop string ends
        the text early, or a step breaks (a typed error from the worker means it already gave up).
        """
        gen = run.gen
        span = self._tracer.start_span(span_name, context=parent, attributes={"worker.id": worker_id})
        replies = None
        handed: Migrated | None = None
        finished = False  # by its last delta, or handed over (nothing to abort then)
        worker_finished = False  # whether the worker's latest delta was its last (else a stop string ended it here)
        generated = run.tokens
        leg: Leg  # (while the replies stream)

        def shown(reply: Message) -> bool:  # each reply as it comes; False: it was the last
            nonlocal handed, finished, worker_finished, generated
            if isinstance(reply, Migrated):
                handed, finished = reply, True  # nothing to abort: the source stopped it
                return False
            assert isinstance(reply, TokenDelta)
            if reply.completion_tokens - len(reply.token_ids) != generated:
                raise StreamInterrupted(
                    f"{worker_id}'s stream went from token {generated} to "
                    f"{reply.completion_tokens - len(reply.token_ids)}: replies were lost"
                )
            generated = reply.completion_tokens
            if leg.heard(len(reply.token_ids), prompt_computed=not run.started):
                span.add_event("first delta")
            delta = run.ends.shown(reply)
            finished, worker_finished = delta.finish_reason is not None, reply.finish_reason is not None
            run.streamed(delta, context_len)
            return not finished

        try:
            with trace.use_span(span, end_on_exit=False):
                replies = await self.bus.stream(subject, request, deadline=gen.deadline)
            with run.held.leg(worker_id, gen.request_id, run, replies.fail) as leg:
                await replies.each(shown)
            if not finished:
                raise MeshError(f"{worker_id} ended the stream without a result")
            if handed is None and not worker_finished:
                await self._abort(worker_id, gen.request_id)  # a stop string the worker could not see
            return handed
        except BaseException as exc:
            if not finished:
                await self._after_failure(worker_id, gen.request_id, exc)
            raise
        finally:
            if replies is not None:
                await replies.close()
            span.end()

    async def _after_failure(self, worker_id: str, request_id: str, exc: BaseException) -> None:
        """Free the worker's slot after `exc` (the client left, the deadline passed, a step broke),
        unless it is a typed error from the worker itself, which means it already gave up; send
        nothing new to a worker NATS found nothing serving, nor to one that refused as full until a
        slot frees."""
        if isinstance(exc, NoResponders):
            self.scheduler.unreachable(worker_id)
        elif isinstance(exc, AtCapacity):
            self.scheduler.refused_at_capacity(worker_id)
        elif not isinstance(exc, MeshError) or isinstance(exc, Timeout):
            await self._abort(worker_id, request_id)

    async def _while_alive(self, worker_id: str, work: Awaitable[T]) -> T:
        """Await `work`, failing with WorkerLost as soon as the worker is declared dead."""
        lost: asyncio.Future[T] = asyncio.get_running_loop().create_future()  # only ever fails
        task = asyncio.ensure_future(work)

        def on_lost(exc: BaseException) -> None:
            if not lost.done():
                lost.set_exception(exc)

        try:
            with self.registry.watch(worker_id, on_lost):
                await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            return lost.result()  # raises WorkerLost
        finally:
            lost.cancel()
            await cancel_and_wait(task)

    async def _abort(self, worker_id: str, request_id: str) -> None:
        try:
            await self.bus.publish(Subjects.abort(worker_id), AbortRequest(request_id=request_id))
            trace.get_current_span().add_event("abort sent", {"worker.id": worker_id})
        except Exception as exc:  # best effort: the worker's deadline ends it anyway
            log.warning("could not send abort for %s to %s: %s", request_id, worker_id, exc)
