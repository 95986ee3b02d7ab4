"""Prefill handler: prompt in, token ids and KV keys out (the KV itself goes to the kv-store)."""

from __future__ import annotations

import time

from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from opentelemetry import trace

from llmesh import telemetry
from llmesh.errors import ContextLengthExceeded, InvalidRequest
from llmesh.messages import PrefillRequest, PrefillResult
from llmesh.worker import EngineWorker


class PrefillService:
    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def tokenize(self, req: PrefillRequest) -> list[int]:
        tok = self.worker.tokenizer
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("`messages` must not be empty", param="messages")
            text = tok.apply_chat_template([m.model_dump() for m in req.messages], tokenize=False,
                                           add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        if req.prompt_token_ids is not None:
            vocab = len(tok)
            if any(not 0 <= t < vocab for t in req.prompt_token_ids):
                raise InvalidRequest(f"prompt token ids must lie in [0, {vocab})", param="prompt")
            return list(req.prompt_token_ids)
        if req.prompt is None:
            raise InvalidRequest("either `prompt` or `messages` is required", param="prompt")
        return tok.encode(req.prompt)

    async def prefill(self, req: PrefillRequest, blob: memoryview) -> PrefillResult:
        if not isinstance(req, PrefillRequest):
            raise InvalidRequest(f"expected PrefillRequest, got {type(req).__name__}")
        token_ids = self.tokenize(req)
        limit = self.worker.max_model_len
        max_tokens = req.max_tokens or limit - len(token_ids)
        if not token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if max_tokens < 1 or len(token_ids) + max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(token_ids) + max(max_tokens, 1)} tokens ({len(token_ids)} in the prompt, "
                f"{max(max_tokens, 1)} for the completion).",
                param="max_tokens" if req.max_tokens else "prompt",
            )
        async with self.worker.admit(req.request_id, req.model, req.deadline, len(token_ids)):
            params = SamplingParams(
                max_tokens=1,
                temperature=0.0,
                extra_args={"kv_transfer_params": {"do_remote_decode": True, "trace": telemetry.inject()}},
            )
            final = None
            started = time.monotonic()
            async for out in self.worker.engine.generate(
                TokensPrompt(prompt_token_ids=token_ids), params, request_id=f"prefill-{req.request_id}"
            ):
                final = out
            assert final is not None
            trace.get_current_span().set_attributes({
                "prompt.tokens": len(token_ids), "prefill.seconds": time.monotonic() - started,
                "kv.blocks": len((final.kv_transfer_params or {}).get("block_hashes", []))})
            return PrefillResult(prompt_token_ids=token_ids, max_tokens=max_tokens, kv_transfer_params=final.kv_transfer_params or {},
                                 fingerprint=self.worker.fingerprint)
