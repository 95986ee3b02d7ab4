"""Prefill handler: prompt in; token ids, the first generated token and KV keys out.

The KV itself goes to the kv-store from inside the engine (llmesh.kv_connector).
"""

from __future__ import annotations

import time

from opentelemetry import trace
from llmesh.errors import ContextLengthExceeded, InvalidRequest
from llmesh.messages import PrefillRequest, PrefillResult, TokenDelta
from llmesh.worker import EngineWorker, sampling_params, tokens_prompt


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

    def resolve_max_tokens(self, req: PrefillRequest, prompt_len: int) -> int:
        if prompt_len == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        limit = self.worker.max_model_len
        max_tokens = req.sampling.max_tokens or limit - prompt_len
        if max_tokens < 1 or prompt_len + max_tokens > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max(max_tokens, 1)} tokens ({prompt_len} in the prompt, "
                f"{max(max_tokens, 1)} for the completion).",
                param="max_tokens" if req.sampling.max_tokens else "prompt",
            )
        return max_tokens

    async def prefill(self, req: PrefillRequest, blob: memoryview) -> PrefillResult:
        if not isinstance(req, PrefillRequest):
            raise InvalidRequest(f"expected PrefillRequest, got {type(req).__name__}")
        token_ids = self.tokenize(req)
        max_tokens = self.resolve_max_tokens(req, len(token_ids))
        async with self.worker.admit(req.request_id, req.model, req.deadline, len(token_ids)):
            params = sampling_params(req.sampling, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
            final = None
            started = time.monotonic()
            async for out in self.worker.engine.generate(
                tokens_prompt(token_ids, req.cache_salt), params, request_id=f"prefill-{req.request_id}"
            ):
                final = out
            assert final is not None
            o = final.outputs[0]
            # "stop" (EOS or a stop string) ends the request here; "length" only if 1 token was asked for.
            finish = o.finish_reason if o.finish_reason == "stop" or max_tokens == 1 else None
            kv_params = final.kv_transfer_params or {}
            span = trace.get_current_span()
            span.set_attributes({"prompt.tokens": len(token_ids), "prefill.seconds": time.monotonic() - started,
                                 "kv.blocks": len(kv_params.get("block_hashes", []))})
            if req.predicted_length is not None:
                span.set_attribute("length.bucket", req.predicted_length.label)
            if finish is not None:  # no decode follows
                await self.worker.report_length(req.request_id, req.predicted_length, len(o.token_ids), finish)
            return PrefillResult(
                prompt_token_ids=token_ids,
                max_tokens=max_tokens,
                first=TokenDelta(text=o.text, token_ids=list(o.token_ids), finish_reason=finish,
                                 prompt_tokens=len(token_ids), completion_tokens=len(o.token_ids)),
                kv_transfer_params=kv_params,
                fingerprint=self.worker.fingerprint,
            )
