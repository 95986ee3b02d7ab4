"""Decode handler: the prompt's KV keys and the first token in, a stream of token deltas out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from opentelemetry import trace
from vllm.sampling_params import RequestOutputKind

from llmesh.errors import InvalidRequest, KVFingerprintMismatch
from llmesh.kvkeys import check_same_layout
from llmesh.messages import DecodeRequest, TokenDelta
from llmesh.worker import EngineWorker, sampling_params, tokens_prompt


class DecodeService:
    def __init__(self, worker: EngineWorker):
        self.worker = worker

    async def decode(self, req: DecodeRequest, blob: memoryview) -> AsyncIterator[TokenDelta]:
        if not isinstance(req, DecodeRequest):
            raise InvalidRequest(f"expected DecodeRequest, got {type(req).__name__}")
        kv_params = dict(req.kv_transfer_params or {})
        if req.fingerprint != self.worker.fingerprint:
            theirs = kv_params.get("kv_layout")
            if theirs:
                check_same_layout(self.worker.layout, theirs)
            raise KVFingerprintMismatch(f"prefill fingerprint {req.fingerprint} != decode {self.worker.fingerprint}")
        total = req.sampling.max_tokens
        if total is None or total < 2 or len(req.prompt_token_ids) + total > self.worker.max_model_len:
            raise InvalidRequest("decode needs 2 <= max_tokens <= the context left after the prompt",
                                 param="max_tokens")
        params = sampling_params(req.sampling, max_tokens=total - 1, kv_transfer_params=kv_params,
                                 output_kind=RequestOutputKind.DELTA)
        if req.predicted_length is not None:
            trace.get_current_span().set_attribute("length.bucket", req.predicted_length.label)
        prompt_tokens, completion_tokens = len(req.prompt_token_ids), 1  # the first came from prefill
        finish_reason = None
        async with self.worker.admit(req.request_id, req.model, req.deadline, total):
            async for out in self.worker.engine.generate(
                tokens_prompt([*req.prompt_token_ids, req.first_token], req.cache_salt), params,
                request_id=f"decode-{req.request_id}",
            ):
                o = out.outputs[0]
                completion_tokens += len(o.token_ids)
                finish_reason = o.finish_reason if out.finished else None
                yield TokenDelta(
                    text=o.text,
                    token_ids=list(o.token_ids),
                    finish_reason=finish_reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                )
        if finish_reason is not None:
            await self.worker.report_length(req.request_id, req.predicted_length, completion_tokens, finish_reason)
