"""Decode handler: token ids and KV keys in, a stream of token deltas out."""

from __future__ import annotations

from collections.abc import AsyncIterator

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind

from llmesh import telemetry
from llmesh.errors import InvalidRequest, KVFingerprintMismatch
from llmesh.kvkeys import check_same_layout
from llmesh.messages import DecodeRequest, TokenDelta
from llmesh.worker import EngineWorker


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
        if len(req.prompt_token_ids) + req.sampling.max_tokens > self.worker.max_model_len:
            raise InvalidRequest("prompt plus max_tokens exceeds the model's context", param="max_tokens")
        s = req.sampling
        params = SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop=s.stop or None,
            seed=s.seed,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": {**kv_params, "trace": telemetry.inject()}},
        )
        prompt_tokens, completion_tokens = len(req.prompt_token_ids), 0
        async with self.worker.admit(req.request_id, req.model, req.deadline, s.max_tokens):
            async for out in self.worker.engine.generate(
                TokensPrompt(prompt_token_ids=req.prompt_token_ids), params, request_id=f"decode-{req.request_id}"
            ):
                o = out.outputs[0]
                completion_tokens += len(o.token_ids)
                yield TokenDelta(
                    text=o.text,
                    token_ids=list(o.token_ids),
                    finish_reason=o.finish_reason if out.finished else None,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                )
