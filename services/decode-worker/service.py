"""Decode handlers.

- `decode`: the prompt's KV keys and the prefill's first token in, a stream of token deltas out.
- `generate`: a whole request on this engine, prefill included, streamed from its first token. The
  router sends one here when the prefill workers are backed up and this engine would answer
  sooner (llmesh.policies.disagg): its engine then computes the prompt between decode steps,
  exactly as a monolithic engine does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from opentelemetry import trace
from vllm.sampling_params import RequestOutputKind

from llmesh.errors import InvalidRequest, KVFingerprintMismatch
from llmesh.kvkeys import check_same_layout
from llmesh.messages import DecodeRequest, LengthPrediction, PrefillRequest, Subjects, TokenDelta
from llmesh.worker import EngineWorker, HeldRequest, sampling_params, tokens_prompt


class DecodeService:
    def __init__(self, worker: EngineWorker):
        self.worker = worker
        worker.generates = True

    def handlers(self) -> dict[str, Any]:
        return {self.worker.subject: self.decode, Subjects.generate(self.worker.worker_id): self.generate}

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
        async with self.worker.admit(req.request_id, req.model, req.deadline, total,
                                     prompt_tokens=len(req.prompt_token_ids), max_tokens=total,
                                     predicted=req.predicted_length, generated=1, priority=req.priority) as held:
            async for delta in self._stream(held, f"decode-{req.request_id}",
                                            [*req.prompt_token_ids, req.first_token], req.cache_salt, params,
                                            req.predicted_length):
                yield delta

    async def generate(self, req: PrefillRequest, blob: memoryview) -> AsyncIterator[TokenDelta]:
        if not isinstance(req, PrefillRequest):
            raise InvalidRequest(f"expected PrefillRequest, got {type(req).__name__}")
        token_ids = self.worker.prompt_token_ids(req)
        max_tokens = self.worker.max_tokens(req, len(token_ids))
        params = sampling_params(req.sampling, max_tokens=max_tokens, kv_transfer_params={"save_prompt": True},
                                 output_kind=RequestOutputKind.DELTA)  # its prompt's KV goes to the store too
        trace.get_current_span().set_attribute("prompt.tokens", len(token_ids))
        async with self.worker.admit(req.request_id, req.model, req.deadline, len(token_ids) + max_tokens,
                                     prompt_tokens=len(token_ids), max_tokens=max_tokens,
                                     predicted=req.predicted_length, priority=req.priority) as held:
            self.worker.prefill_meter.started()
            computed = 0
            try:
                async for delta in self._stream(held, f"generate-{req.request_id}", token_ids,
                                                req.cache_salt, params, req.predicted_length):
                    if not computed:  # the prompt is computed once the first token is out
                        computed = len(token_ids)
                        self.worker.prefill_meter.finished(computed)
                    yield delta
            finally:
                if not computed:
                    self.worker.prefill_meter.finished(0)

    async def _stream(self, held: HeldRequest, engine_request_id: str, token_ids: list[int], cache_salt: str | None,
                      params: Any, predicted: LengthPrediction | None) -> AsyncIterator[TokenDelta]:
        """The engine's output as token deltas (`held.generated` tokens already generated elsewhere),
        counted on `held`; the actual length goes back to the predictor at the end."""
        if predicted is not None:
            trace.get_current_span().set_attribute("length.bucket", predicted.label)
        finish_reason = None
        async for out in self.worker.engine.generate(tokens_prompt(token_ids, cache_salt), params,
                                                     request_id=engine_request_id):
            o = out.outputs[0]
            held.generated += len(o.token_ids)
            finish_reason = o.finish_reason if out.finished else None
            yield TokenDelta(text=o.text, token_ids=list(o.token_ids), finish_reason=finish_reason,
                             prompt_tokens=held.prompt_tokens, completion_tokens=held.generated)
        if finish_reason is not None:
            await self.worker.report_length(held.request_id, predicted, held.generated, finish_reason)
