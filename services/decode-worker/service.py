"""Decode handlers.

- `decode`: a request's tokens so far in (the prompt and every output token streamed, one after a
  prefill), a stream of token deltas out. The KV of all but the last token is loaded from the
  store; the engine computes just the last one. The same handler continues a request after a
  live migration or a failover.
- `generate`: a whole request on this engine, prefill included, streamed from its first token. The
  router sends one here when the prefill workers are backed up and this engine would answer
  sooner (llmesh.policies.disagg): its engine then computes the prompt between decode steps,
  exactly as a monolithic engine does.
- `migrate` (as the source) and `prepare` (as the target): live migration, Llumnix's protocol
  through the kv-store. While the source keeps decoding, the target fetches the blocks already
  stored (full blocks are written behind as they fill) into its engine's prefix cache, and the
  source's engine writes the request's partial last block every step too (`DurableTail`). Then the
  source stops the request at a step boundary, waits until the store holds every block of what it
  streamed (the partial one written at its step; else the one its engine exports as it stops), and
  ends its stream with `Migrated`; the router resumes the request on the target with the tokens it
  streamed. A target that refuses leaves the request running on the source; one that fails after
  the hand-over is replaced by the router (llmesh_router.dispatch), as a dead source is.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from itertools import accumulate
from typing import Any

from opentelemetry import trace
from vllm.sampling_params import RequestOutputKind

from llmesh.engine.detokenizer import (
    LOGPROB_CONTEXT,
    ContinuedText,
    logprob_steps,
    prompt_logprob_fields,
)
from llmesh.engine.kvclient import ChunkLocator, KvClient, ShardDirectory, leading_run
from llmesh.engine.worker import EngineWorker, HeldRequest, sampling_params, tokens_prompt
from llmesh.wire.errors import InvalidRequest, KVFingerprintMismatch, MeshError, ServiceUnavailable
from llmesh.wire.kvkeys import block_hashes, check_same_layout, tail_hash
from llmesh.wire.messages import (
    Ack,
    DecodeRequest,
    DurableTail,
    KvHandle,
    LengthPrediction,
    LogprobSteps,
    LoraAdapter,
    MigrateCommand,
    Migrated,
    MigrateOutcome,
    MigratePrepare,
    PrefillRequest,
    SamplingOptions,
    Subjects,
    TokenDelta,
    kv_blocks,
)

log = logging.getLogger(__name__)

PREPARE_TIMEOUT_S = 10.0  # the target's answer to a hand-shake (its prefetch included)
PREFETCH_BUDGET_S = 2.0  # past this the target agrees without its prefetch (it loads everything at the hand-over)
EXPORT_WAIT_S = 5.0  # how long the source waits for the store to hold the request's blocks
CONTROL_TIMEOUT_S = 2.0  # the engine's connector's answer to `DurableTail`, and the steps waited after it
DURABLE_STEPS = 2  # tokens awaited after `DurableTail` is on: the step in flight was planned before it
OUTCOMES_KEPT = 1024  # answers to recent migration commands, for idempotent retries


class DecodeService:
    def __init__(self, worker: EngineWorker):
        self.worker = worker
        cache = worker.engine.vllm_config.cache_config
        self.block_size = cache.block_size
        self._store: KvClient | None = None
        self._store_lock = asyncio.Lock()
        self._outcomes: OrderedDict[str, MigrateOutcome] = OrderedDict()
        self._tracer = trace.get_tracer("llmesh.decode")

    def handlers(self) -> dict[str, Any]:
        asyncio.get_running_loop().create_task(self._warm_up())
        wid = self.worker.worker_id
        return {
            self.worker.subject: self.decode,
            Subjects.generate(wid): self.generate,
            Subjects.migrate(wid): self.migrate,
            Subjects.migrate_in(wid): self.prepare,
        }

    # ---- serving ----------------------------------------------------------------------------

    async def decode(self, req: DecodeRequest, blob: memoryview) -> AsyncIterator[TokenDelta | Migrated]:
        if not isinstance(req, DecodeRequest):
            raise InvalidRequest(f"expected DecodeRequest, got {type(req).__name__}")
        self._check_layout(req.fingerprint, req.kv.kv_layout if req.kv else None)
        total, done = req.sampling.max_tokens, len(req.output_token_ids)
        if total is None or done >= total or len(req.prompt_token_ids) + total > self.worker.max_model_len:
            raise InvalidRequest(
                "decode needs output tokens so far < max_tokens <= the context left after the prompt",
                param="max_tokens",
            )
        trace.get_current_span().set_attributes(
            {
                "request.id": req.request_id,
                "worker.id": self.worker.worker_id,
                "decode.resumed_at": done,
                "decode.migration_id": req.migration_id or "",
                "decode.kv": "handle" if req.kv else "recompute" if req.recompute else "lookup",
            }
        )
        kv_params: dict[str, Any] = req.kv.params() if req.kv else {"fingerprint": req.fingerprint}
        if req.recompute:
            kv_params["recompute"] = True
        async with self.worker.admit(
            req.request_id,
            req.model,
            req.deadline,
            total - done,
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=total,
            predicted=req.predicted_length,
            generated=done,
            priority=req.priority,
            migration_id=req.migration_id,
        ) as held:
            self._name_admission(
                held, "decode", [*req.prompt_token_ids, *req.output_token_ids], req.cache_salt, req.lora
            )
            if done and self.worker.settings.length_refine_every:  # resumed: the output so far, for the refinements
                held.output_text.append(
                    await asyncio.get_running_loop().run_in_executor(
                        None, self.worker.tokenizer.decode, req.output_token_ids
                    )
                )
            # Text is made here, continuing the stream's (llmesh.engine.detokenizer); stop strings, which need
            # the text, are the router's to find.
            reasoning, constrained = self.worker.reasoning_kwargs(
                req.sampling, req.prompt_token_ids, req.output_token_ids
            )
            params = sampling_params(
                req.sampling.model_copy(update={"stop": []}),
                max_tokens=total - done,
                generated=done,
                tokenizer=self.worker.tokenizer,
                constrained=constrained,
                kv_transfer_params=kv_params | {"tail_id": held.tail_id},
                output_kind=RequestOutputKind.DELTA,
                detokenize=False,
            )
            text = ContinuedText(
                self.worker.tokenizer,
                req.prompt_token_ids,
                req.output_token_ids,
                req.sampling.skip_special_tokens,
                req.sampling.spaces_between_special_tokens,
            )
            async for delta in self._stream(
                held,
                held.engine_request_id,
                list(held.token_ids),
                req.cache_salt,
                params,
                req.predicted_length,
                text,
                reasoning,
            ):
                yield delta
            if held.migration is not None and not held.finished:
                yield await self._hand_over(held)

    async def generate(self, req: PrefillRequest, blob: memoryview) -> AsyncIterator[TokenDelta | Migrated]:
        if not isinstance(req, PrefillRequest):
            raise InvalidRequest(f"expected PrefillRequest, got {type(req).__name__}")
        token_ids = await self.worker.prompts.prompt_token_ids(req)
        max_tokens = self.worker.max_tokens(req, len(token_ids))
        trace.get_current_span().set_attribute("prompt.tokens", len(token_ids))
        async with self.worker.admit(
            req.request_id,
            req.model,
            req.deadline,
            len(token_ids) + max_tokens,
            prompt_tokens=len(token_ids),
            max_tokens=max_tokens,
            predicted=req.predicted_length,
            priority=req.priority,
        ) as held:
            self._name_admission(held, "generate", list(token_ids), req.cache_salt, req.lora)
            params = sampling_params(
                req.sampling,
                max_tokens=max_tokens,
                tokenizer=self.worker.tokenizer,
                output_kind=RequestOutputKind.DELTA,
                kv_transfer_params={"save_prompt": True, "tail_id": held.tail_id},
            )
            reasoning, _ = self.worker.reasoning_kwargs(req.sampling, token_ids)
            self.worker.prefill_meter.started()  # its prompt's KV goes to the store too
            computed = 0
            try:
                async for delta in self._stream(
                    held,
                    held.engine_request_id,
                    token_ids,
                    req.cache_salt,
                    params,
                    req.predicted_length,
                    reasoning=reasoning,
                ):
                    if not computed:  # the prompt is computed once the first token is out
                        computed = len(token_ids)
                        self.worker.prefill_meter.finished(computed)
                        delta = delta.model_copy(  # the router may resume it from its prompt
                            update={
                                "prompt_token_ids": token_ids,
                                "prompt_text": await self.worker.prompts.shown_text(req, token_ids),
                            }
                        )
                    yield delta
            finally:
                if not computed:
                    self.worker.prefill_meter.finished(0)
            if held.migration is not None and not held.finished and computed:
                yield await self._hand_over(held)

    async def _stream(
        self,
        held: HeldRequest,
        engine_request_id: str,
        token_ids: list[int],
        cache_salt: str | None,
        params: Any,
        predicted: LengthPrediction | None,
        text: ContinuedText | None = None,
        reasoning: dict[str, Any] | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """The engine's output as token deltas (`held.generated` tokens already generated elsewhere),
        counted on `held`, with their text from `text` if given (else the engine's), started with `reasoning`
        (generate()'s reasoning arguments: llmesh.engine.reasoning); the actual length
        goes back to the predictor at the end."""
        if predicted is not None:
            trace.get_current_span().set_attribute("length.bucket", predicted.label)
        finish_reason = None
        span, first = trace.get_current_span(), True
        async for out in self.worker.generate(
            tokens_prompt(token_ids, cache_salt), params, engine_request_id, lora=held.lora, **(reasoning or {})
        ):
            o = out.outputs[0]
            opening = first and held.generated == 0  # the request's first output (not a resumed one's)
            if first:
                span.add_event("first output")
                first = False
            held.generated += len(o.token_ids)
            held.token_ids.extend(o.token_ids)
            # stopped for a migration: the engine's "abort" is not the end of the request
            handed_over = out.finished and o.finish_reason == "abort" and held.migration is not None
            finish_reason = o.finish_reason if out.finished and not handed_over else None
            held.finished = finish_reason is not None
            if out.finished:
                self.worker.count_preemptions(out.kv_transfer_params)
            if o.token_ids or not handed_over:
                # a token that stopped the engine (end of sequence, stop_token_ids) shows no text, as in vLLM
                hidden = finish_reason == "stop" and not params.include_stop_str_in_output
                piece, text_ends = o.text, None
                if text is not None:
                    pieces = text.feed_each(o.token_ids[:-1] if hidden else o.token_ids)
                    piece = "".join(pieces)
                    if len(o.token_ids) > 1:  # (vLLM joined steps its reader was slow to take)
                        ends = list(accumulate(map(len, pieces)))
                        text_ends = ends + [len(piece)] * (len(o.token_ids) - len(ends))  # (a hidden last token's)
                self.worker.refine_length(held, piece)
                yield TokenDelta(
                    text=piece,
                    text_ends=text_ends,
                    token_ids=list(o.token_ids),
                    finish_reason=finish_reason,
                    stop_reason=o.stop_reason if finish_reason in ("stop", "repetition") else None,
                    prompt_tokens=held.prompt_tokens,
                    completion_tokens=held.generated,
                    cached_tokens=out.num_cached_tokens if opening else None,
                    logprobs=o.logprobs and self._logprobs(held, o),
                    **prompt_logprob_fields(self.worker.tokenizer, token_ids, out.prompt_logprobs),
                )
        if finish_reason is not None:
            await self.worker.report_length(held.request_id, predicted, held.generated, finish_reason)

    def _logprobs(self, held: HeldRequest, output: Any) -> LogprobSteps:
        """The logprobs of `output`'s new tokens (the last of `held.token_ids`), with the output before them."""
        end = len(held.token_ids) - len(output.token_ids)
        before = held.token_ids[max(end - LOGPROB_CONTEXT, len(held.token_ids) - held.generated) : end]
        return logprob_steps(self.worker.tokenizer, output.logprobs, before)

    def _name_admission(
        self, held: HeldRequest, kind: str, token_ids: list[int], cache_salt: str | None, lora: LoraAdapter | None
    ) -> None:
        """What a migration needs of the engine request `held` starts: its tokens so far, salt and adapter,
        its engine id, and the unique id its exported blocks are named by."""
        held.token_ids, held.cache_salt, held.lora = token_ids, cache_salt, lora
        held.tail_id = f"{self.worker.worker_id}/{held.request_id}/{held.generated}/{uuid.uuid4().hex[:8]}"
        held.engine_request_id = f"{kind}-{held.tail_id}"

    def _check_layout(self, fingerprint: str, layout: dict[str, Any] | None) -> None:
        if fingerprint != self.worker.fingerprint:
            if layout:
                check_same_layout(self.worker.layout, layout)
            raise KVFingerprintMismatch(f"KV fingerprint {fingerprint} != this worker's {self.worker.fingerprint}")

    # ---- live migration: the source ---------------------------------------------------------

    async def migrate(self, cmd: MigrateCommand, blob: memoryview) -> MigrateOutcome:
        """Hand a running request over to `cmd.target`: hand-shake (the target holds a slot and
        prefetches), then stop it here; its stream ends with `Migrated` (see `_hand_over`)."""
        if not isinstance(cmd, MigrateCommand):
            raise InvalidRequest(f"expected MigrateCommand, got {type(cmd).__name__}")
        if (known := self._outcomes.get(cmd.migration_id)) is not None:
            return known
        held = self.worker.held(cmd.request_id)
        span = trace.get_current_span()
        span.set_attributes(
            {
                "migration.id": cmd.migration_id,
                "request.id": cmd.request_id,
                "migration.target": cmd.target,
                "migration.reason": cmd.reason,
            }
        )
        if held is not None and held.span_context is not None:
            span.add_link(held.span_context, {"link": "the migrated request"})  # the command has a trace of its own
        if held is None or not held.engine_request_id or held.finished:
            return self._outcome(cmd, False, f"request {cmd.request_id} is not decoding on {self.worker.worker_id}")
        if held.migration is not None:
            return self._outcome(cmd, False, f"already migrating ({held.migration.migration_id})")
        if cmd.target == self.worker.worker_id:
            return self._outcome(cmd, False, "the target is the source")
        held.migration = cmd
        # the tail written every step from now on, so the switch need not wait for an export
        durable = None if cmd.recompute else asyncio.create_task(self._durable_from(held))
        try:
            await self.worker.bus.request(
                Subjects.migrate_in(cmd.target),
                MigratePrepare(
                    migration_id=cmd.migration_id,
                    request_id=cmd.request_id,
                    model=self.worker.settings.model_name,
                    fingerprint=self.worker.fingerprint,
                    token_ids=list(held.token_ids),
                    max_tokens_left=max(held.max_tokens - held.generated, 1),
                    cache_salt=held.cache_salt,
                    lora=held.lora,
                    hold_s=PREPARE_TIMEOUT_S,
                    prefetch=not cmd.recompute,
                ),
                Ack,
                timeout=PREPARE_TIMEOUT_S,
            )
            durable_from = await durable if durable is not None else None
            held.tail_durable = durable_from is not None and await self._generated_reaches(held, durable_from)
        except MeshError as exc:
            return await self._refused(cmd, held, durable, f"{cmd.target} refused: {exc.message}")
        if held.finished or self.worker.held(cmd.request_id) is not held:
            return await self._refused(cmd, held, durable, "the request finished during the hand-shake")
        await self.worker.engine.abort(held.engine_request_id)  # takes effect at the next step boundary
        return self._outcome(cmd, True)

    async def _refused(
        self, cmd: MigrateCommand, held: HeldRequest, durable: asyncio.Task | None, reason: str
    ) -> MigrateOutcome:
        """The migration is off: the request decodes on here as before."""
        held.migration, held.tail_durable = None, False
        if durable is not None and await durable is not None:
            await self._durable_tail(held, False)
        return self._outcome(cmd, False, reason)

    async def _durable_tail(self, held: HeldRequest, on: bool) -> bool:
        """Turn writing `held`'s partial last block every step on or off in the engine's connector."""
        try:
            await self.worker.bus.request(
                Subjects.kv_control(self.worker.worker_id),
                DurableTail(tail_id=held.tail_id, on=on),
                Ack,
                timeout=CONTROL_TIMEOUT_S,
            )
            return True
        except MeshError as exc:
            log.warning("request %s: the connector did not take DurableTail(on=%s): %s", held.request_id, on, exc)
            return False

    async def _durable_from(self, held: HeldRequest) -> int | None:
        """Turn the durable tail on for `held`; from which count of its generated tokens on the tail
        of what it streamed is surely stored (None: not on). The step in flight was planned before."""
        return held.generated + DURABLE_STEPS if await self._durable_tail(held, True) else None

    @staticmethod
    async def _generated_reaches(held: HeldRequest, count: int) -> bool:
        """Wait (a bounded time) until `held` has generated `count` tokens; False if it finished first."""
        give_up = time.monotonic() + CONTROL_TIMEOUT_S
        while held.generated < count and not held.finished and time.monotonic() < give_up:
            await asyncio.sleep(0.001)
        return held.generated >= count

    def _outcome(self, cmd: MigrateCommand, accepted: bool, reason: str = "") -> MigrateOutcome:
        outcome = MigrateOutcome(
            migration_id=cmd.migration_id,
            request_id=cmd.request_id,
            source=self.worker.worker_id,
            target=cmd.target,
            accepted=accepted,
            reason=reason,
        )
        if not accepted:
            log.info("migration %s of %s to %s refused: %s", cmd.migration_id, cmd.request_id, cmd.target, reason)
        trace.get_current_span().set_attributes({"migration.accepted": accepted, "migration.refusal": reason})
        self._outcomes[cmd.migration_id] = outcome
        while len(self._outcomes) > OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)
        return outcome

    async def _hand_over(self, held: HeldRequest) -> Migrated:
        """The stopped request's hand-over: a KV handle for every token streamed but the last, once
        the store holds those blocks (the connector exports the partial last one as the request stops)."""
        cmd = held.migration
        assert cmd is not None
        outputs = len(held.token_ids) - held.prompt_tokens
        if cmd.recompute:
            return Migrated(migration_id=cmd.migration_id, target=cmd.target, kv=None, output_tokens=outputs)
        with self._tracer.start_as_current_span("migration.export") as span:
            size, loadable = self.block_size, len(held.token_ids) - 1
            full = loadable // size
            seed = self.worker.kv_seed(held.cache_salt, held.lora)
            hashes = block_hashes(seed, held.token_ids[: full * size], size)
            ends = []  # names of the partial last block, best first: written at its step, or exported at the stop
            if loadable % size:
                if held.tail_durable:
                    ends += block_hashes(
                        hashes[-1] if hashes else seed, held.token_ids[full * size : loadable], size, partial=True
                    )
                ends.append(tail_hash(held.tail_id, full))
            stored, end = await self._wait_stored(hashes, ends)
            if stored < len(hashes):  # a block missing: hand over the run before it (the target recomputes the rest)
                hashes, end = hashes[:stored], None
            durable = end is not None and end != ends[-1]  # else an exported tail, named as such in the handle
            span.set_attributes(
                {
                    "request.id": held.request_id,
                    "kv.blocks": len(hashes) + bool(end),
                    "kv.complete": stored == full and bool(end or not ends),
                    "kv.tail": "durable" if durable else "exported" if end else "none",
                }
            )
        kv = KvHandle(
            fingerprint=self.worker.fingerprint,
            block_size=size,
            block_hashes=[*hashes, end] if durable else hashes,
            tail_hash=None if durable else end,
            num_tokens=min(loadable, (len(hashes) + bool(end)) * size),
            pinned_until=time.time() + self.worker.settings.kv_pin_s,
        )
        return Migrated(migration_id=cmd.migration_id, target=cmd.target, kv=kv, output_tokens=outputs)

    async def _warm_up(self) -> None:
        """Find the store and open a connection now, not on the first migration's clock."""
        try:
            await asyncio.to_thread((await self._client()).contains, ["warm-up"])
        except MeshError as exc:
            log.warning("kv-store not reachable yet (%s): looked up on first use", exc)

    async def _client(self) -> KvClient:
        """The kv-store, for lookups (made on first use; transfers stay in the engine's connector)."""
        async with self._store_lock:
            if self._store is None:
                directory = ShardDirectory(self.worker.bus)
                await directory.start()
                redis_url = self.worker.settings.redis_url
                self._store = KvClient(
                    directory,
                    timeout=5.0,
                    connections_per_shard=2,
                    locator=ChunkLocator(redis_url) if redis_url else None,
                )
        return self._store

    async def _stored_run(self, hashes: list[str]) -> int:
        """How many of `hashes`, from the first, the store holds whole (0 if it cannot say)."""
        try:
            return await asyncio.to_thread((await self._client()).stored_run, hashes, self.worker.layout)
        except MeshError as exc:
            log.warning("KV lookup failed: %s", exc)
            return 0

    async def _wait_stored(self, hashes: list[str], ends: list[str]) -> tuple[int, str | None]:
        """Wait (a bounded time) until the store holds every block of `hashes` (in every layer) and one
        of `ends`, names of the block after them; how many of `hashes` it holds from the first, and
        the first of `ends` it holds."""
        give_up = time.monotonic() + EXPORT_WAIT_S
        while True:
            try:
                present = await asyncio.to_thread(
                    (await self._client()).stored_blocks, [*hashes, *ends], self.worker.layout
                )
            except MeshError as exc:
                log.warning("KV lookup failed: %s", exc)
                present = [False] * (len(hashes) + len(ends))
            stored = leading_run(present[: len(hashes)])
            end = next((name for name, ok in zip(ends, present[len(hashes) :]) if ok), None)
            if (stored == len(hashes) and (end or not ends)) or time.monotonic() >= give_up:
                break
            await asyncio.sleep(0.002)
        if stored < len(hashes) or (ends and end is None):
            log.warning(
                "the store holds %d of %d blocks to hand over after %.0f s",
                stored + bool(end),
                len(hashes) + bool(ends),
                EXPORT_WAIT_S,
            )
        return stored, end

    # ---- live migration: the target ---------------------------------------------------------

    async def prepare(self, req: MigratePrepare, blob: memoryview) -> Ack:
        """Take a migration: hold a slot, and load the request's stored blocks into the engine's
        prefix cache now (one throw-away token computed after them), so that the hand-over loads
        only what was generated since. Refused (an error) without room for the request's KV."""
        if not isinstance(req, MigratePrepare):
            raise InvalidRequest(f"expected MigratePrepare, got {type(req).__name__}")
        worker = self.worker
        if req.model != worker.settings.model_name:
            raise InvalidRequest(f"this worker serves {worker.settings.model_name!r}, not {req.model!r}")
        self._check_layout(req.fingerprint, None)
        worker.check_room()
        info = worker.info()
        needed = kv_blocks(len(req.token_ids) + 1, self.block_size)
        free = info.kv_blocks_total - info.kv_blocks_used
        if info.kv_blocks_total and needed > free:
            raise ServiceUnavailable(f"{worker.worker_id} has {free} free KV blocks; the request needs {needed}")
        worker.reserve(req.migration_id, req.hold_s)
        if req.prefetch:
            with self._tracer.start_as_current_span("migration.prefetch") as span:
                span.set_attributes({"migration.id": req.migration_id, "request.id": req.request_id})
                try:
                    async with asyncio.timeout(PREFETCH_BUDGET_S):  # cancelled: vLLM aborts the prefetch
                        span.set_attribute("kv.blocks", await self._prefetch(req))
                except TimeoutError:
                    log.warning(
                        "migration %s: prefetch took over %.0f s; agreeing without it",
                        req.migration_id,
                        PREFETCH_BUDGET_S,
                    )
                    span.set_attribute("kv.prefetch_timed_out", True)
            worker.reserve(req.migration_id, req.hold_s)  # the hand-over's window starts with the answer
        return Ack()

    async def _prefetch(self, req: MigratePrepare) -> int:
        """Load the stored full blocks of `req`'s tokens into the engine (they stay in vLLM's prefix
        cache); the blocks loaded."""
        size = self.block_size
        full = (len(req.token_ids) - 1) // size
        hashes = block_hashes(self.worker.kv_seed(req.cache_salt, req.lora), req.token_ids[: full * size], size)
        stored = await self._stored_run(hashes)
        trace.get_current_span().set_attribute("kv.stored", stored)  # what the store held: a timeout is not a miss
        if not stored:
            return 0
        params = sampling_params(
            SamplingOptions(max_tokens=1, temperature=0.0),
            max_tokens=1,
            kv_transfer_params={
                "fingerprint": self.worker.fingerprint,
                "block_hashes": hashes[:stored],
                "prefetch": True,
            },
        )
        prompt = tokens_prompt(req.token_ids[: stored * size + 1], req.cache_salt)
        async for _ in self.worker.generate(prompt, params, f"prefetch-{req.migration_id}", lora=req.lora):
            pass
        return stored
