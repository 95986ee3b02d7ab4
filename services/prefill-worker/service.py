"""Prefill handler: prompt in; token ids, the first generated token and KV keys out.

The KV itself goes to the kv-store from inside the engine (llmesh.engine.kv_connector).
"""

from __future__ import annotations

import time

from opentelemetry import trace

from llmesh.engine.detokenizer import logprob_steps, prompt_logprob_fields
from llmesh.engine.worker import EngineWorker, sampling_params, tokens_prompt
from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import KvHandle, PrefillRequest, PrefillResult, TokenDelta


class PrefillService:
    def __init__(self, worker: EngineWorker):
        self.worker = worker

    async def prefill(self, req: PrefillRequest, blob: memoryview) -> PrefillResult:
        if not isinstance(req, PrefillRequest):
            raise InvalidRequest(f"expected PrefillRequest, got {type(req).__name__}")
        token_ids = await self.worker.prompts.prompt_token_ids(req)
        max_tokens = self.worker.max_tokens(req, len(token_ids))
        async with self.worker.admit(
            req.request_id,
            req.model,
            req.deadline,
            len(token_ids),
            prompt_tokens=len(token_ids),
            max_tokens=max_tokens,
            predicted=req.predicted_length,
            priority=req.priority,
        ):
            params = sampling_params(
                req.sampling,
                max_tokens=1,
                kv_transfer_params={"do_remote_decode": True},
                tokenizer=self.worker.tokenizer,
            )
            reasoning, _ = self.worker.reasoning_kwargs(req.sampling, token_ids)
            final = None
            started = time.monotonic()
            self.worker.prefill_meter.started()
            computed = 0
            try:
                async for out in self.worker.generate(
                    tokens_prompt(token_ids, req.cache_salt),
                    params,
                    f"prefill-{req.request_id}",
                    lora=req.lora,
                    **reasoning,
                ):
                    final = out
                computed = len(token_ids)
            finally:
                self.worker.prefill_meter.finished(computed)
            assert final is not None
            o, tokenizer = final.outputs[0], self.worker.tokenizer
            shown = await self.worker.prompts.shown_text(req, token_ids)
            # "stop" (EOS or a stop string) ends the request here; "length" only if 1 token was asked for.
            finish = o.finish_reason if o.finish_reason == "stop" or max_tokens == 1 else None
            kv_params = final.kv_transfer_params or {}
            self.worker.count_preemptions(kv_params)
            kv = (
                KvHandle(
                    fingerprint=self.worker.fingerprint,
                    block_size=kv_params.get("block_size", 1),
                    block_hashes=kv_params.get("block_hashes", []),
                    num_tokens=len(token_ids),
                    kv_layout=kv_params.get("kv_layout"),
                    pinned_until=time.time() + self.worker.settings.kv_pin_s,
                )
                if kv_params
                else None
            )
            span = trace.get_current_span()
            span.set_attributes(
                {
                    "prompt.tokens": len(token_ids),
                    "prefill.seconds": time.monotonic() - started,
                    "kv.blocks": len(kv.block_hashes) if kv else 0,
                }
            )
            if req.predicted_length is not None:
                span.set_attribute("length.bucket", req.predicted_length.label)
            if finish is not None:  # no decode follows
                await self.worker.report_length(req.request_id, req.predicted_length, len(o.token_ids), finish)
            return PrefillResult(
                prompt_token_ids=token_ids,
                max_tokens=max_tokens,
                first=TokenDelta(
                    text=o.text,
                    token_ids=list(o.token_ids),
                    finish_reason=finish,
                    stop_reason=o.stop_reason if finish == "stop" else None,
                    prompt_tokens=len(token_ids),
                    completion_tokens=len(o.token_ids),
                    cached_tokens=final.num_cached_tokens,
                    logprobs=o.logprobs and logprob_steps(tokenizer, o.logprobs, []),
                    prompt_text=shown,
                    **prompt_logprob_fields(tokenizer, token_ids, final.prompt_logprobs),
                ),
                kv=kv,
                fingerprint=self.worker.fingerprint,
            )
