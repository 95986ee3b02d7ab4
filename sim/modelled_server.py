"""A modelled engine behind an OpenAI-compatible HTTP server, as vLLM's own server fronts its engine: for
routers that front HTTP engines (vllm-router), benchmarked at GPU speed beside the mesh over the same
modelled engines (bench/control_plane.py). A benchmark tool, like `llmesh_sim.modelled_engine`.

    python -m llmesh_sim.modelled_server --model DIR --port PORT [--profile h100-llama2-7b] [--timings DIR]

Serves `/v1/models`, `/health` and `/v1/completions` (a prompt of text or token ids; streamed as vLLM streams it,
a chunk a step, or whole; every request runs to its `max_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

import uvicorn

from .modelled_engine import ModelledEngine


def engine(model: str, served: str, profile: str, max_model_len: int, block_size: int, seqs: int, timings: str) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(
        model=model,
        served_model_name=served,
        max_model_len=max_model_len,
        block_size=block_size,
        max_num_seqs=seqs,
        enforce_eager=True,
        disable_log_stats=True,
    )
    settings = SimpleNamespace(modelled_engine=profile, modelled_kv_bytes_per_token=0, modelled_timings_dir=timings)
    return ModelledEngine.start(args, settings, f"modelled-server-{uuid.uuid4().hex[:6]}")


class App:
    """The three routes, as plain ASGI (a benchmark's server should cost little beside what it fronts)."""

    def __init__(self, engine: Any, served: str):
        self.engine, self.served = engine, served
        self.tokenizer = engine.get_tokenizer()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if path == "/v1/models":
            await self._json(send, {"object": "list", "data": [{"id": self.served, "object": "model"}]})
        elif path == "/health":
            await self._json(send, {})
        elif path == "/v1/completions" and scope["method"] == "POST":
            body = b""
            while True:
                message = await receive()
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
            await self._complete(json.loads(body), send)
        else:
            await self._json(send, {"error": "not found"}, 404)

    @staticmethod
    async def _json(send: Any, value: Any, status: int = 200) -> None:
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": json.dumps(value).encode()})

    async def _complete(self, body: dict, send: Any) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params = SamplingParams(max_tokens=body.get("max_tokens") or 16, output_kind=RequestOutputKind.DELTA)
        created, stream = int(time.time()), bool(body.get("stream"))
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.served}
        outputs = self.engine.generate({"prompt_token_ids": ids}, params, request_id)
        if not stream:
            tokens: list[int] = []
            async for out in outputs:
                tokens += out.outputs[0].token_ids
            choice = {"index": 0, "text": self.tokenizer.decode(tokens), "logprobs": None, "finish_reason": "length"}
            usage = {
                "prompt_tokens": len(ids),
                "completion_tokens": len(tokens),
                "total_tokens": len(ids) + len(tokens),
            }
            await self._json(send, head | {"choices": [choice], "usage": usage})
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for out in outputs:
            o = out.outputs[0]
            choice = {"index": 0, "text": self.tokenizer.decode(o.token_ids), "logprobs": None}
            choice["finish_reason"] = o.finish_reason
            event = b"data: " + json.dumps(head | {"choices": [choice]}).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the model's folder (its config and tokenizer)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--profile", default="h100-llama2-7b")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--timings", default="", help="a folder for each request's engine time to its first token")
    args = parser.parse_args(argv)
    served = args.served_model_name or args.model
    modelled = engine(
        args.model, served, args.profile, args.max_model_len, args.block_size, args.max_num_seqs, args.timings
    )
    config = uvicorn.Config(App(modelled, served), host="127.0.0.1", port=args.port, log_level="warning", loop="uvloop")
    asyncio.run(uvicorn.Server(config).serve())


if __name__ == "__main__":
    main()
