"""The whole disaggregated path on real components: nats-server, kv-store, vLLM prefill and
decode engines, the router, driven by the official OpenAI client.

Test order matters only at the end: the fault tests kill the decode worker, so they run last.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from llmesh.deploy.launcher import engine_cores, start_service
from llmesh.engine.detokenizer import ContinuedText
from llmesh.engine.vllm_plugin import engine_cores as cores_named
from llmesh.wire.bus import Bus
from llmesh.wire.errors import KVFingerprintMismatch, MeshError
from llmesh.wire.messages import (
    DecodeRequest,
    Detokenized,
    DetokenizeTokens,
    KvDiscover,
    KvFlush,
    KvHandle,
    KvStats,
    KvStatsRequest,
    LengthPrediction,
    LengthPredictRequest,
    LengthStats,
    LengthStatsRequest,
    PlacementRequest,
    PrefillRequest,
    PrefillResult,
    SamplingOptions,
    Subjects,
    Tokenized,
    TokenizePrompt,
    WorkerInfo,
    decode_any,
    encode,
)

from .conftest import BLOCK_SIZE, MAX_MODEL_LEN, MODEL_B, assert_echoed_as_vllm, extra_workers, launched

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
MODEL = "llmesh/tiny-llama"
NUM_LAYERS = 4
DIRECT_DEADLINE_S = 300  # a request sent straight to the workers (`disaggregated`)
BF16_TIE = 0.1  # logprob gap within bf16 rounding of logits of this model's size


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(10, 2000) for _ in range(length - 1)]


@pytest.fixture(scope="module")
def client(reference, mesh):  # reference first: its engine loads while the mesh starts
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=mesh.api_key, max_retries=0, timeout=60)


async def kv_stats(mesh, op: str = "stats", timeout: float = 120) -> KvStats:
    """The kv-store's counters; `op="flush"` spills its memory to SSD first (every earlier test's KV:
    once 30 s did not do under the suite's load)."""
    bus = await Bus.connect(mesh.nats_url, f"test-{op}")
    try:
        request = KvFlush() if op == "flush" else KvStatsRequest()
        stats, _ = await bus.request(Subjects.kv("0", op), request, KvStats, timeout=timeout)
        return stats
    finally:
        await bus.close()


async def live_worker(mesh, role: str, worker_id: str | None = None) -> WorkerInfo | None:
    """The next heartbeat of a `role` worker (of `worker_id`, if given); None if none comes in 3 s."""
    bus = await Bus.connect(mesh.nats_url, "test-heartbeats")
    seen: asyncio.Queue[WorkerInfo] = asyncio.Queue()

    async def on_heartbeat(info, blob):
        if info.role == role and worker_id in (None, info.worker_id):
            seen.put_nowait(info)

    try:
        await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
        return await asyncio.wait_for(seen.get(), 3)
    except TimeoutError:
        return None
    finally:
        await bus.close()


# ---- the OpenAI client against the running mesh ---------------------------------------------------


def test_models_and_health(client, mesh):
    assert [m.id for m in client.models.list().data] == [MODEL, MODEL_B]
    health = httpx.get(f"{mesh.url}/health").json()
    assert health["status"] == "ok" and health["workers"] == {"prefill": 1, "decode": 1}


def test_each_engine_is_forked_from_its_worker_onto_its_cores_and_the_service_runs_on_every_core(mesh):
    """`make run` gives each single-rank engine its cores, so its worker prepares before torch loads
    (llmesh.engine.standby) and forks the EngineCore and the model Worker from itself instead of spawning
    two fresh interpreters; they compute on the engine's cores, and the service is back on all of its own."""
    workers = [
        psutil.Process(pid)
        for pid, program in launched(mesh).items()
        if program.endswith(("llmesh_prefill", "llmesh_decode"))
    ]
    assert len(workers) == 2
    for worker in workers:
        cores = sorted(cores_named(worker.environ()["MESH_CPU_CORES"]))
        (engine,) = [p for p in worker.children() if p.name().startswith("VLLM::EngineCor")]
        (model,) = [p for p in engine.children() if p.name().startswith("VLLM::Worker")]
        assert engine.cpu_affinity() == model.cpu_affinity() == cores, worker.cmdline()
        assert {frozenset(os.sched_getaffinity(t.id)) for t in worker.threads()} == {frozenset(os.sched_getaffinity(0))}
        log = Path(os.readlink(f"/proc/{worker.pid}/fd/1"))  # where the launcher sends its output
        assert "forking the engine's processes from this prepared one" in log.read_text()


def test_completions_streaming_equals_non_streaming(client, reference):
    prompt = "The history of the printing press begins"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    assert full.choices[0].text == reference.generate(20, prompt=prompt)["text"]


def test_chat_streaming_and_non_streaming(client, tokenizer):
    """... and with vLLM's return_prompt_text, the rendered template's text on the answer, or on the first chunk
    alone, as vLLM's server gives it; with its chat echo, the continued message before the output."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    shown = {"return_prompt_text": True}
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=shown
    )
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=shown,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert full.prompt_text == chunks[0].prompt_text == rendered  # type: ignore[attr-defined]
    assert [getattr(c, "prompt_text", None) for c in chunks[1:]] == [None] * (len(chunks) - 1)
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert getattr(plain, "prompt_text", None) is None
    # vLLM's chat echo: a continued last message shown before its continuation
    partial = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    alone, echoed = (
        client.chat.completions.create(
            model=MODEL, messages=partial, max_tokens=6, temperature=0, extra_body=continued | extra
        ).choices[0]
        for extra in ({}, {"echo": True})
    )
    assert echoed.message.content == "The color is" + (alone.message.content or "")


def test_stop_sequences_and_seeded_sampling(client, reference):
    text = client.completions.create(model=MODEL, prompt="Lists are", max_tokens=30, temperature=0).choices[0].text
    stop = text[5:8]
    stopped = client.completions.create(model=MODEL, prompt="Lists are", max_tokens=30, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
    assert stopped.choices[0].stop_reason == stop  # vLLM's field: the stop string (None at the end of sequence)
    for stream in (False, True):
        kept = client.completions.create(
            model=MODEL,
            prompt="Lists are",
            max_tokens=30,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"include_stop_str_in_output": True},
        )
        kept_text = "".join(c.choices[0].text for c in kept) if stream else kept.choices[0].text
        expected = reference.generate(30, prompt="Lists are", stop=[stop], include_stop_str_in_output=True)
        assert kept_text == expected["text"] and kept_text.endswith(stop), (kept_text, expected["text"])


def test_seeded_sampling_is_the_monolithic_engines_across_prefill_and_decode(client, reference):
    """The prefill samples the first token from the seed's stream; decode's stream starts past that draw,
    where the monolithic engine's stands: without that, decode would draw the first token's noise again."""
    ids = token_prompt(120, seed=3535)
    fields = {"temperature": 0.9, "top_p": 0.9, "top_k": 50}
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=24, seed=7, n=2, extra_body={"return_token_ids": True} | fields
    )
    for choice in out.choices:  # choice i samples with seed + i
        expected = reference.generate(24, prompt_token_ids=ids, seed=7 + choice.index, **fields)
        assert (choice.token_ids, choice.text) == (expected["token_ids"], expected["text"])
    assert out.choices[0].token_ids != out.choices[1].token_ids


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


# ---- exactness ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length",
    [
        50,  # shorter than a KV block: one partial block
        BLOCK_SIZE,
        BLOCK_SIZE + 1,  # on and just past a block boundary
        3 * BLOCK_SIZE,
        3 * BLOCK_SIZE + 1,  # the boundary that trapped vLLM's example connector
        1000,
        1500,  # many blocks
        MAX_MODEL_LEN - 24,  # near the context limit
    ],
)
def test_greedy_output_equals_monolithic_vllm(client, reference, mesh, tokenizer, length):
    ids = token_prompt(length, seed=length)
    before = asyncio.run(kv_stats(mesh))
    out = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
    )
    after = asyncio.run(kv_stats(mesh))
    expected = reference.generate(16, prompt_token_ids=ids)
    assert out.choices[0].token_ids == expected["token_ids"]
    if tokenizer.decode(ids[-8:]).endswith("\ufffd"):
        # The prompt ends inside a character: vLLM's own text starts with the whole prompt's
        # (vllm-project/vllm#48853); the mesh's is its slow incremental algorithm's, which the fix
        # there falls back to.
        assert out.choices[0].text == ContinuedText(tokenizer, ids, []).feed(expected["token_ids"])
    else:
        assert out.choices[0].text == expected["text"]
    # decode loaded every block of the prompt (the partial last one too) from the store, missing none
    loaded_blocks = -(-length // BLOCK_SIZE)
    assert after.hits - before.hits == loaded_blocks * NUM_LAYERS
    assert after.misses == before.misses


def completed_with(client, ids: list[int], max_tokens: int, fields: dict):
    """The greedy completion's choice (with its token ids) of `ids` with `fields`: OpenAI's `logit_bias` as the
    client takes it, vLLM's fields in the body."""
    return client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        logit_bias=fields.get("logit_bias"),
        extra_body={"return_token_ids": True} | {k: v for k, v in fields.items() if k != "logit_bias"},
    ).choices[0]


def assert_choice_is(out, expected: dict, asked: object) -> None:
    """A completion's choice is the reference engine's output: its tokens, finish and stop reasons, and text."""
    fields = ("token_ids", "finish_reason", "stop_reason", "text")
    assert tuple(getattr(out, f) for f in fields) == tuple(expected[f] for f in fields), asked


def test_vllms_sampling_fields_are_exact_across_prefill_and_decode(client, reference, tokenizer):
    """Each changes the greedy output (the first token sampled by prefill, the rest by decode, which sees
    the first as its prompt's last) and equals a monolithic engine's with the same fields."""
    ids = token_prompt(300, seed=3131)
    eos = tokenizer.eos_token_id
    plain = reference.generate(16, prompt_token_ids=ids)
    for fields in [
        {"repetition_penalty": 1.8},  # on prompt and output tokens: the same set after the hand-over
        # on the output alone: decode counts the prefill's token, its prompt's end (negative: repeats, so a change)
        {"frequency_penalty": -2.0},
        {"presence_penalty": -1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3},
        {"min_tokens": 5, "logit_bias": {str(eos): 100}},  # no end before 5 tokens, then at once
        {"logit_bias": {str(plain["token_ids"][3]): 4.0}},
        {"stop_token_ids": [plain["token_ids"][5]]},  # decode's: it ends there, its text not shown
        {"stop_token_ids": [plain["token_ids"][0]]},  # prefill's
        {"stop_token_ids": [plain["token_ids"][5]], "include_stop_str_in_output": True},  # its text shown
        {"stop_token_ids": [plain["token_ids"][0]], "include_stop_str_in_output": True},
    ]:
        out = completed_with(client, ids, 16, fields)
        assert_choice_is(out, reference.generate(16, prompt_token_ids=ids, **fields), fields)
        assert out.token_ids != plain["token_ids"], f"{fields} changed nothing"


def test_repetition_detection_ends_the_output_where_the_monolithic_engine_ends_it(client, reference):
    """vLLM's repetition_detection over the whole output: a pattern that the prefill's token begins is in no
    decode engine's output, so the router checks it too, and the output ends at the token that completes it
    (its finish_reason "repetition", stop_reason "repetition_detected"), as one engine ends it."""
    ids = token_prompt(300, seed=3131)
    ends = []
    for detect in (
        {"max_pattern_size": 1, "min_count": 2},
        {"max_pattern_size": 3, "min_pattern_size": 2, "min_count": 2},
        {"max_pattern_size": 4, "min_count": 3},
    ):
        # (a negative penalty repeats; a token lifted above the rest repeats from the prefill's token on)
        for fields in ({"frequency_penalty": -2.0}, {}, {"logit_bias": {"1000": 100}}):
            asked = fields | {"repetition_detection": detect}
            out = completed_with(client, ids, 24, asked)
            assert_choice_is(out, reference.generate(24, prompt_token_ids=ids, **asked), asked)
            ends.append((len(out.token_ids), out.finish_reason))
    print(f"(tokens, finish_reason) of each: {ends}")
    # the prefill's token and decode's first (and second): in no engine's output whole, seen by the router
    assert (2, "repetition") in ends and (3, "repetition") in ends
    assert sum(reason == "repetition" for _, reason in ends) >= 5


STRUCTURES = [
    {
        "json": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"type": "integer"}},
            "required": ["name", "size"],
        },
        "disable_any_whitespace": True,
    },
    {"regex": "(alpha|beta)( [0-9]{2}){6}"},
    {"choice": ["the quick brown fox jumps over", "a lazy dog sleeps in the sun", "lists are"]},
    {"grammar": 'root ::= "(" item (", " item)* ")"\nitem ::= [a-z]+'},
    {"json_object": True, "disable_any_whitespace": True},
]


@pytest.mark.parametrize("structure", STRUCTURES, ids=lambda s: next(iter(s)))
def test_structured_output_is_the_monolithic_engines_across_prefill_and_decode(client, reference, structure):
    """The prefill samples the first token under the grammar; decode's grammar starts past it (its prompt's
    last token), as the monolithic engine's stands: without that, decode's grammar would start over."""
    ids = token_prompt(200, seed=3434)
    out = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=40,
        temperature=0,
        extra_body={"return_token_ids": True, "structured_outputs": structure},
    ).choices[0]
    expected = reference.generate(40, prompt_token_ids=ids, structured_outputs=structure)
    assert (out.token_ids, out.finish_reason, out.text) == (
        expected["token_ids"],
        expected["finish_reason"],
        expected["text"],
    )
    assert len(out.token_ids) > 2  # decode's part is under test
    if "json" in structure and out.finish_reason == "stop":
        assert set(json.loads(out.text)) == {"name", "size"}
    if "choice" in structure:
        assert out.text in structure["choice"]


def test_response_format_json_schema_in_chat_streamed_and_whole_is_the_monolithic_engines(client, reference, tokenizer):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    chat = [{"role": "user", "content": "Answer in JSON."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=30, temperature=0, response_format=fmt
    )
    streamed = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=30, temperature=0, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    template = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(template, add_special_tokens=False)  # as the workers apply it
    expected = reference.generate(30, prompt_token_ids=ids, structured_outputs={"json": schema})
    assert whole.choices[0].message.content == text == expected["text"]
    assert text.startswith("{")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}


def streamed_calls(chunks) -> tuple[list[tuple[str, str]], str | None]:
    """A streamed answer's tool calls (name, arguments), as a client accumulates them, and its finish reason."""
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                if call.id:
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
    return [(name, arguments) for name, arguments in calls.values()], finish


@pytest.mark.parametrize("choice", ["named", "required"])
def test_tool_calls_streamed_and_whole_are_the_monolithic_engines_constrained_output(
    client, reference, tokenizer, choice
):
    """The tools and a history of calls and results reach the chat template; the output is the monolithic
    engine's under vLLM's own constraint for the choice, read back as OpenAI's tool calls."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    tools = [WEATHER, TIME]
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    chat = [
        {"role": "user", "content": "What is the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "noon"},
        {"role": "user", "content": "And the weather in Oslo for two days?"},
    ]
    # (this random model pads JSON with whitespace: this seed shows a call within 60 tokens)
    sampling = {"temperature": 0.0} if choice == "named" else {"temperature": 0.7, "seed": 5}
    asked = {"model": MODEL, "messages": chat, "tools": tools, "tool_choice": tool_choice, "max_tokens": 60} | sampling
    whole = client.chat.completions.create(**asked, extra_body={"return_token_ids": True})
    calls, finish = streamed_calls(client.chat.completions.create(**asked, stream=True))

    theirs = ChatCompletionRequest(**asked)
    schema = get_json_schema_from_tools(theirs.tool_choice, theirs.tools, theirs.parallel_tool_calls)
    template_messages = [dict(m) for m in chat]
    template_messages[1] = {**chat[1], "content": "", "tool_calls": [{**chat[1]["tool_calls"][0]}]}
    template_messages[1]["tool_calls"][0]["function"] = {"name": "get_time", "arguments": {}}  # (as vLLM parses it)
    vllm_tools = [t.model_dump() for t in theirs.tools]  # (as vLLM's server hands them to the template)
    text = tokenizer.apply_chat_template(
        template_messages, tools=vllm_tools, add_generation_prompt=True, tokenize=False
    )
    assert '"get_weather"' in text and '"get_time", "arguments": {}' in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = reference.generate(60, prompt_token_ids=ids, structured_outputs={"json": schema}, **sampling)

    answer = whole.choices[0]
    assert whole.usage.prompt_tokens == len(ids) and answer.message.content == ""
    got = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls or ()]
    if choice == "named":
        assert got == calls == [("get_weather", expected["text"])]
        assert answer.finish_reason == finish == expected["finish_reason"]
    else:  # (the array may not close in time: read back as vLLM reads what it gave)
        from pydantic import TypeAdapter, ValidationError
        from vllm.entrypoints.generate.base.protocol import FunctionDefinition
        from vllm.tool_parsers.streaming import extract_required_tool_call_streaming

        try:
            read = TypeAdapter(list[FunctionDefinition]).validate_json(expected["text"])
        except ValidationError:
            read = []
        assert got == [(f.name, json.dumps(f.parameters, ensure_ascii=False)) for f in read]
        revealed, _ = extract_required_tool_call_streaming(
            previous_text="", current_text=expected["text"], tool_call_idx=None, tool_call_id_type="random"
        )
        assert calls == [(c.function.name, c.function.arguments) for c in (revealed.tool_calls if revealed else ())]
        assert calls, expected["text"]  # a call was streamed
        reason = "tool_calls" if expected["finish_reason"] == "stop" else expected["finish_reason"]
        assert answer.finish_reason == finish == reason
    assert answer.token_ids == expected["token_ids"]


def test_auto_tool_calls_are_the_monolithic_engines_output_read_by_the_models_parser(client, reference, tokenizer):
    """tool_choice "auto" (the default with tools) on the session's model, whose catalogue entry names vLLM's
    pythonic parser: an output constrained to a call list is read back, whole and streamed (over the
    prefill's and decode's legs), as that parser reads the monolithic engine's; a plain output stays text;
    a model without a parser refuses "auto" with vLLM's 400."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager

    calls_only = r"\[get_weather\(city='Oslo'\), get_time\(\)\]"
    asked = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "The weather in Oslo, and the time?"}],
        "tools": [WEATHER, TIME],
        "max_tokens": 60,
        "temperature": 0,
    }
    forced = asked | {"extra_body": {"structured_outputs": {"regex": calls_only}, "return_token_ids": True}}
    whole = client.chat.completions.create(**forced)
    calls, finish = streamed_calls(client.chat.completions.create(**forced, stream=True))
    plain = client.chat.completions.create(**asked)

    theirs = ChatCompletionRequest(**asked)
    text = tokenizer.apply_chat_template(
        asked["messages"], tools=[t.model_dump() for t in theirs.tools], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = reference.generate(60, prompt_token_ids=ids, structured_outputs={"regex": calls_only})
    parser = ParserManager.get_parser(tool_parser_name="pythonic", enable_auto_tools=True, tokenizer=tokenizer)
    _, _, read = parser(tokenizer, theirs.tools).parse(expected["text"], theirs, True, expected["token_ids"])
    answer = whole.choices[0]
    assert answer.token_ids == expected["token_ids"] and answer.message.content is None
    got = [(c.function.name, c.function.arguments) for c in answer.message.tool_calls]
    assert (
        got
        == calls
        == [(c.name, c.arguments) for c in read]
        == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    )
    assert answer.finish_reason == finish == "tool_calls"
    as_text = reference.generate(60, prompt_token_ids=ids)
    assert (plain.choices[0].message.content, plain.choices[0].finish_reason) == (
        as_text["text"],
        as_text["finish_reason"],
    )
    assert not plain.choices[0].message.tool_calls

    with pytest.raises(openai.BadRequestError, match="tool_call_parser") as refused:
        client.chat.completions.create(**asked | {"model": MODEL_B})
    assert refused.value.param == "tool_choice"


def test_responses_are_the_monolithic_engines_output_whole_streamed_continued_and_calling_tools(
    client, reference, tokenizer
):
    """OpenAI's Responses API over the chat path: a response, whole and streamed, is the monolithic engine's
    output for the chat template of its instructions and input; the second time its prompt's whole blocks are
    reported cached; a response continued by its id sees the conversation so far (its instructions not carried
    over); a history of calls and their outputs renders as the chat's, and calls come back as the model's parser
    reads them."""

    def template_ids(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)  # (as vLLM's server encodes a chat)

    sea = f"Tell me about the sea, {time.time_ns()}. " + "Waves and tides. " * 60  # (not cached by another test)
    asked = {"model": MODEL, "instructions": "Be brief.", "input": sea, "max_output_tokens": 24, "temperature": 0}
    whole = client.responses.create(**asked)
    ids = template_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": sea}])
    expected = reference.generate(24, prompt_token_ids=ids)
    assert whole.output_text == expected["text"]
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(ids), len(expected["token_ids"]))
    assert whole.status == ("incomplete" if expected["finish_reason"] == "length" else "completed")
    events = list(client.responses.create(**asked, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected["text"]
    ended = events[-1].response
    assert ended.output_text == expected["text"] and ended.id != whole.id
    assert ended.usage.input_tokens_details.cached_tokens == (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert client.responses.retrieve(whole.id).output_text == expected["text"]
    assert [item.content[0].text for item in client.responses.input_items.list(whole.id).data] == [sea]

    following = client.responses.create(
        model=MODEL, previous_response_id=whole.id, input="And the sky?", max_output_tokens=16, temperature=0
    )
    conversation = [
        {"role": "user", "content": sea},
        {"role": "assistant", "content": expected["text"]},
        {"role": "user", "content": "And the sky?"},
    ]
    assert following.output_text == reference.generate(16, prompt_token_ids=template_ids(conversation))["text"]

    calls_only = r"\[get_weather\(city='Oslo'\), get_time\(\)\]"
    tools = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
    items = [
        {"role": "user", "content": "What is the time?"},
        {"type": "function_call", "call_id": "c0", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c0", "output": "noon"},
        {"role": "user", "content": "And the weather in Oslo?"},
    ]
    chat = [
        items[0],
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c0", "type": "function", "function": items[1]}]},
        {"role": "tool", "tool_call_id": "c0", "content": "noon"},
        items[3],
    ]
    constrained = {
        "max_output_tokens": 60,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": calls_only}},
    }
    called = client.responses.create(model=MODEL, input=items, tools=tools, **constrained)
    streamed = list(client.responses.create(model=MODEL, input=items, tools=tools, stream=True, **constrained))
    as_chat = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": calls_only}},
    )
    assert called.usage.input_tokens == as_chat.usage.prompt_tokens  # the same prompt, rendered from the items
    expected_calls = [(c.function.name, c.function.arguments) for c in as_chat.choices[0].message.tool_calls]
    assert expected_calls == [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]
    for output in (called.output, streamed[-1].response.output):
        assert [(o.type, o.name, o.arguments) for o in output] == [("function_call", *c) for c in expected_calls]
        assert len({o.call_id for o in output}) == 2


def test_template_variables_special_tokens_allowed_tokens_and_truncation_reach_the_engines_as_vllms_server_passes_them(
    client, reference, tokenizer
):
    chat = [{"role": "user", "content": "Say a word."}, {"role": "assistant", "content": "The word is"}]
    continued = client.chat.completions.create(
        model=MODEL,
        messages=chat,
        max_tokens=12,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True},
    )
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert text.endswith("The word is")
    ids = tokenizer.encode(text, add_special_tokens=False)
    expected = reference.generate(12, prompt_token_ids=ids)
    assert continued.usage.prompt_tokens == len(ids) and continued.choices[0].token_ids == expected["token_ids"]
    assert continued.model_extra["prompt_token_ids"] == ids  # (vLLM's return_token_ids: a chat's prompt, once)

    allowed = tokenizer.encode(" the a of and to in is", add_special_tokens=False)
    completion = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=20,
        temperature=0,
        extra_body={"add_special_tokens": False, "allowed_token_ids": allowed, "return_token_ids": True},
    )
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)  # (no <s>)
    expected = reference.generate(20, prompt_token_ids=ids, allowed_token_ids=allowed)
    assert completion.usage.prompt_tokens == len(ids) and completion.choices[0].token_ids == expected["token_ids"]
    assert set(expected["token_ids"]) <= set(allowed) and len(expected["token_ids"]) == 20

    # special tokens' text shown, by the prefill's detokenizer and decode's (the allowed ones make them likely)
    specials = tokenizer.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    for skip, spaces in ((False, True), (True, True), (False, False)):
        shown = client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0,
            extra_body={
                "allowed_token_ids": [*specials, *allowed[:3]],
                "skip_special_tokens": skip,
                "spaces_between_special_tokens": spaces,
            },
        ).choices[0]
        expected = reference.generate(
            16,
            prompt_token_ids=tokenizer.encode("Once upon a time"),
            allowed_token_ids=[*specials, *allowed[:3]],
            skip_special_tokens=skip,
            spaces_between_special_tokens=spaces,
        )
        assert shown.text == expected["text"]
        assert ("<|" in shown.text) is not skip, shown.text

    # truncated prompts: a text's from the left, echoed whole (as vLLM's server echoes it); token ids from the right
    text = "Once upon a time there was a small village by the sea, where the fishermen told stories every night."
    ids = tokenizer.encode(text)
    for prompt, fields, kept, echoed in (
        (text, {"truncate_prompt_tokens": 9, "truncation_side": "left"}, ids[-9:], text),
        (ids, {"truncate_prompt_tokens": 7, "truncation_side": "right"}, ids[:7], tokenizer.decode(ids)),
    ):
        cut = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=0, echo=True, extra_body=fields
        )
        assert cut.usage.prompt_tokens == len(kept)
        assert cut.choices[0].text == echoed + reference.generate(10, prompt_token_ids=kept)["text"]
    # with return_token_ids, vLLM's server echoes the prompt's ids, not its text
    cut = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, echo=True, extra_body=fields | {"return_token_ids": True}
    )
    assert (cut.choices[0].text, cut.choices[0].prompt_token_ids) == (
        reference.generate(10, prompt_token_ids=kept)["text"],
        kept,
    )


def test_tokenize_gives_the_prompt_its_generation_gets_and_detokenize_the_tokenizers_text(client, mesh, tokenizer):
    """vLLM's /tokenize and /detokenize: a chat's ids are the ones its chat completion's engine got (with
    tools, documents and a continued last message too), a text's with and without special tokens; every
    worker of the model answers the same."""

    def post(path: str, body: dict, headers: dict | None = None) -> httpx.Response:
        return httpx.post(f"{mesh.url}{path}", json=body, headers=mesh.headers if headers is None else headers)

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    chats = [
        ({"messages": [{"role": "user", "content": "Say a word."}]}, {}),
        (
            {
                "messages": [{"role": "user", "content": "Look it up."}, {"role": "assistant", "content": "I will"}],
                "tools": tools,
                "documents": [{"title": "a", "text": "b"}],
                "add_generation_prompt": False,
                "continue_final_message": True,
            },
            {"tool_choice": "none"},
        ),
    ]
    for fields, chat_only in chats:
        tokenized = post("/tokenize", {"model": MODEL, **fields, "return_token_strs": True})
        assert tokenized.status_code == 200, tokenized.text
        body = tokenized.json()
        generated = client.chat.completions.create(
            model=MODEL,
            messages=fields["messages"],
            max_tokens=1,
            temperature=0,
            extra_body={**fields, **chat_only, "return_token_ids": True},
        )
        assert body["tokens"] == generated.model_extra["prompt_token_ids"]
        assert body["count"] == len(body["tokens"]) == generated.usage.prompt_tokens
        assert body["max_model_len"] == MAX_MODEL_LEN
        assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    for special in (True, False):
        text = post("/tokenize", {"model": MODEL, "prompt": "Once upon a time", "add_special_tokens": special}).json()
        assert text["tokens"] == tokenizer.encode("Once upon a time", add_special_tokens=special)
        assert text["token_strs"] is None
    completion = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert completion.choices[0].prompt_token_ids == tokenizer.encode("Once upon a time")

    ids = tokenizer.encode("Once upon a time, there was <|user|> a fox.")
    assert post("/detokenize", {"model": MODEL, "tokens": ids}).json() == {"prompt": tokenizer.decode(ids)}

    async def asked_directly() -> list[tuple[object, object]]:  # each worker of the model, prefill and decode
        bus = await Bus.connect(mesh.nats_url, "test-tokenizer")
        try:
            answers = []
            for role in ("prefill", "decode"):
                worker = await live_worker(mesh, role)
                assert worker is not None and worker.model == MODEL
                subject = Subjects.tokenizer(worker.worker_id)
                prompt = TokenizePrompt(model=MODEL, prompt="Once upon a time")
                tokenized, _ = await bus.request(subject, prompt, Tokenized, timeout=30)
                text, _ = await bus.request(subject, DetokenizeTokens(model=MODEL, tokens=ids), Detokenized, timeout=30)
                answers.append((tokenized.tokens, text.text))
            return answers
        finally:
            await bus.close()

    assert asyncio.run(asked_directly()) == [(tokenizer.encode("Once upon a time"), tokenizer.decode(ids))] * 2

    cards = {card.id: card.model_extra for card in client.models.list().data}
    assert cards[MODEL]["max_model_len"] == MAX_MODEL_LEN and cards[MODEL]["root"] == MODEL

    for path, body, status, param in (
        ("/detokenize", {"model": MODEL, "tokens": [len(tokenizer)]}, 400, "tokens"),
        ("/tokenize", {"prompt": "hi"}, 400, "model"),  # the session's mesh has two models
        ("/tokenize", {"model": "no-such-model", "prompt": "hi"}, 404, "model"),
        (
            "/tokenize",
            {"model": MODEL, "messages": fields["messages"], "chat_template": "{{ 1 }}"},
            400,
            "chat_template",
        ),
        ("/tokenize", {"model": MODEL, "messages": [], "add_generation_prompt": True}, 400, "messages"),
        (
            "/tokenize",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
    ):
        refused = post(path, body)
        assert (refused.status_code, refused.json()["error"]["param"]) == (status, param), (body, refused.text)
    assert post("/tokenize", {"model": MODEL, "prompt": "hi"}, headers={}).status_code == 401


def test_bad_words_are_banned_over_the_whole_output_as_the_monolithic_engine_bans_them(
    client, reference, tokenizer, mesh
):
    """A two-token bad word whose first token the prefill generated: the decode engine, which holds that token
    in its prompt, bans the second after it, as one engine bans it after its own output."""

    def as_a_bad_word(text: str) -> list[int]:  # the ids vLLM bans for a word (it also tries a leading space)
        return tokenizer.encode(text.lstrip(), add_special_tokens=False)

    for seed in range(7000, 7040):  # a prompt whose first two output tokens are a word as vLLM tokenizes it
        ids = token_prompt(60, seed=seed)
        plain = reference.generate(12, prompt_token_ids=ids)["token_ids"]
        word = tokenizer.decode(plain[:2])
        if word.strip() and as_a_bad_word(word) == plain[:2]:
            break
    else:
        pytest.fail("no prompt of 40 began its output with a two-token word")
    for bad in ([word], [tokenizer.decode(plain[:1]).strip() or word, "zebra"]):
        out = client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=12,
            temperature=0,
            extra_body={"bad_words": bad, "return_token_ids": True},
        ).choices[0]
        expected = reference.generate(12, prompt_token_ids=ids, bad_words=bad)["token_ids"]
        assert out.token_ids == expected != plain, bad
    assert expected[:1] != plain[:1]  # the prefill banned a one-token word
    resp = httpx.post(  # (vLLM's error: a word of no tokens)
        f"{mesh.url}/v1/completions", headers=mesh.headers, json={"model": MODEL, "prompt": "a", "bad_words": ["   "]}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "bad_words", resp.text


def test_logprobs_are_the_monolithic_engines_across_prefill_and_decode(client, reference):
    """Values and texts (each candidate's text, which vLLM corrects with the output before it) as the
    monolithic engine gives them, for the prefill's first token and decode's after it, in both APIs."""
    ids = token_prompt(300, seed=3232)
    expected = reference.generate(16, prompt_token_ids=ids, top=True)  # 5 likeliest a token, as asked below
    steps = expected["steps"]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0, logprobs=5).choices[0]
    assert out.logprobs.tokens == [step[0][2] for step in steps]
    assert out.logprobs.token_logprobs == [step[0][1] for step in steps]
    assert out.logprobs.top_logprobs == [{text: lp for _, lp, text in step} for step in steps]
    assert out.logprobs.text_offset == list(itertools.accumulate(map(len, out.logprobs.tokens[:-1]), initial=0))
    chat = [{"role": "user", "content": "Lists are"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    ).choices[0]
    streamed = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    content = [
        entry
        for chunk in streamed
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [c.model_dump() for c in content] == [c.model_dump() for c in whole.logprobs.content]
    assert len(content) == 12 and all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)

    # vLLM's logprob_token_ids: these tokens' logprobs with each output token's, the likeliest's instead
    labels = [5, 17, 900]
    expected = reference.generate(16, prompt_token_ids=ids, logprob_token_ids=labels)["steps"]
    assert all(
        [t for t, _, _ in step if t != step[0][0]] == [t for t in labels if t != step[0][0]] for step in expected
    )
    scored = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=16, temperature=0, logprobs=1, extra_body={"logprob_token_ids": labels}
    ).choices[0]
    assert scored.logprobs.top_logprobs == [{text: lp for _, lp, text in step} for step in expected]
    asked = {"logprobs": True, "extra_body": {"logprob_token_ids": labels}}
    chat_scored = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0, **asked)
    chat_ids = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=6, temperature=0, extra_body={"return_token_ids": True}
    )
    assert [c.token for c in chat_scored.choices[0].logprobs.content] == [
        step[0].token for step in (c.top_logprobs for c in chat_scored.choices[0].logprobs.content)
    ]
    assert all(len(c.top_logprobs) in (3, 4) for c in chat_scored.choices[0].logprobs.content)
    assert len(chat_ids.choices[0].token_ids) == len(chat_scored.choices[0].logprobs.content)


def test_echo_gives_each_prompt_with_its_logprobs_as_the_monolithic_engine_computes_them(client, reference):
    """How evaluation harnesses (lm-eval's loglikelihood) score text: prompts echoed with logprobs and one
    token generated. The prefill computes each whole prompt, also where the store holds its blocks
    (vLLM needs every position's logits), and its text is the prompt decoded, or as given."""
    prompts = [token_prompt(300, seed=3636), token_prompt(130, seed=3737)]
    expected = [reference.generate(1, prompt_token_ids=ids, prompt_logprobs=1, logprobs=1) for ids in prompts]
    for _ in range(2):  # the second time, the store holds the prompts' blocks
        out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True)
        for choice, answer in zip(out.choices, expected):
            assert_echoed_as_vllm(choice, answer, top=1)
    alone = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=0, temperature=0, logprobs=1, echo=True
    )
    assert alone.choices[0].logprobs.tokens == out.choices[0].logprobs.tokens[:-1]  # the prompt's, nothing after
    assert alone.choices[0].text == expected[0]["prompt_text"]
    text = client.completions.create(model=MODEL, prompt="Lists are", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Lists are", max_tokens=4, temperature=0)
    assert text.choices[0].text == "Lists are" + plain.choices[0].text and text.choices[0].logprobs is None
    streamed = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0, logprobs=1, echo=True, stream=True
    )
    tokens = [token for chunk in streamed for token in chunk.choices[0].logprobs.tokens]
    whole = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=6, temperature=0, logprobs=1, echo=True
    )
    assert tokens == whole.choices[0].logprobs.tokens and len(tokens) == 130 + 6


def test_prompt_logprobs_are_the_monolithic_engines_with_their_ranks(client, reference):
    """vLLM's `prompt_logprobs`: every prompt token's logprob and rank with the likeliest, as vLLM's server
    shows them, for each of a completion's prompts (the prefill computes the whole prompt, also where the
    store holds its blocks) and a chat's rendered prompt; an echo's logprobs show as many as it asks."""
    prompts = [token_prompt(200, seed=3838), token_prompt(70, seed=3939)]
    expected = [reference.generate(1, prompt_token_ids=ids, prompt_logprobs=3)["prompt_logprobs"] for ids in prompts]
    for _ in range(2):  # the second time, the store holds the prompts' blocks
        out = client.completions.create(
            model=MODEL, prompt=prompts, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
        )
        assert [c.prompt_logprobs for c in out.choices] == expected
    echoed = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=1, temperature=0, logprobs=1, echo=True,
        extra_body={"prompt_logprobs": 3},
    )  # fmt: skip
    assert echoed.choices[0].prompt_logprobs == expected[1]
    assert all(len(top) == 2 for top in echoed.choices[0].logprobs.top_logprobs[1:70])  # its own and 1
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Lists are"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 1, "return_token_ids": True},
    )
    assert (
        chat.prompt_logprobs
        == reference.generate(1, prompt_token_ids=chat.prompt_token_ids, prompt_logprobs=1)["prompt_logprobs"]
    )


def test_n_choices_of_several_prompts_are_each_a_request_through_prefill_and_decode(client, reference):
    """Greedy, every choice of each prompt is the monolithic engine's output for that prompt: each token
    within a bf16 tie of the likeliest given those before it (the choices share the engines' batches,
    and vLLM is not batch-invariant). Streamed and sampled with a seed, each choice gets its own seed."""
    prompts = [token_prompt(300, seed=3434), token_prompt(90, seed=3535)]
    whole = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=16, temperature=0, n=2, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]  # prompt i's choice j at i·n + j
    assert [c.prompt_token_ids for c in whole.choices] == [prompts[0]] * 2 + [prompts[1]] * 2  # (vLLM's)
    assert whole.usage.prompt_tokens == 300 + 90
    assert whole.usage.completion_tokens == sum(len(c.token_ids) for c in whole.choices)
    for choice in whole.choices:
        gaps = reference.greedy_gaps(prompts[choice.index // 2], choice.token_ids)
        assert max(gaps) < BF16_TIE, (choice, gaps)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Lists are"}],
            max_tokens=12,
            temperature=1.0,
            seed=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # (vLLM's: usage so far)
        )
    )
    texts = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        for i in (0, 1)
    ]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 2 and all(texts) and texts[0] != texts[1]
    assert chunks[-1].usage.completion_tokens <= 24
    so_far = [[c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == i] for i in (0, 1)]
    assert all(counts == sorted(counts) and counts[0] >= 1 for counts in so_far)
    assert so_far[0][-1] + so_far[1][-1] == chunks[-1].usage.completion_tokens


def test_sixteen_concurrent_requests_each_get_their_own_output(client, reference, mesh):
    prompts = [token_prompt(40 + 97 * i, seed=100 + i) for i in range(16)]
    aclient = openai.AsyncOpenAI(base_url=f"{mesh.url}/v1", api_key=mesh.api_key, max_retries=0, timeout=120)

    async def one(ids):
        r = await aclient.completions.create(
            model=MODEL, prompt=ids, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
        )
        return r.choices[0].token_ids

    async def all_():
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    outputs = asyncio.run(all_())
    assert len({tuple(o) for o in outputs}) == len(prompts)
    # Batched decode steps (up to 16 rows here, 1 in the reference) round bf16 differently: vLLM is
    # not batch-invariant. So an output may leave the reference's path, but only at a near-tie, where
    # its token is the reference's runner-up by a hair. Wrong KV or crossed requests cannot hide so.
    exact = 0
    for ids, out in zip(prompts, outputs):
        ref = reference.generate(24, prompt_token_ids=ids, top=True)
        if out == ref["token_ids"]:
            exact += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(out, ref["token_ids"])) if a != b)
        top = ref["top"][step]
        assert step > 0 and str(out[step]) in top, f"diverged at token {step} to a non-contender: {top}"
        gap = top[str(ref["token_ids"][step])] - top[str(out[step])]
        assert gap < BF16_TIE, f"diverged at token {step} where the reference was sure (gap {gap:.3f})"
    assert exact >= len(prompts) // 2


# ---- one trace across the services ---------------------------------------------------------------------


def test_one_trace_spans_router_prefill_kvstore_decode(mesh):
    trace_id, root_span = f"{random.getrandbits(128):032x}", f"{random.getrandbits(64):016x}"
    httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=60,
        headers={**mesh.headers, "traceparent": f"00-{trace_id}-{root_span}-01"},
        json={"model": MODEL, "prompt": token_prompt(600, seed=5), "max_tokens": 4},
    ).raise_for_status()
    time.sleep(1)
    spans = [s for s in mesh.spans() if s["context"]["trace_id"] == f"0x{trace_id}"]
    by_id = {s["context"]["span_id"]: s for s in spans}
    service = {sid: s["resource"]["attributes"]["service.name"] for sid, s in by_id.items()}
    assert {"router", "prefill-worker", "kv-store", "decode-worker"} <= set(service.values())

    def ancestors(span):
        chain = []
        while span["parent_id"] and span["parent_id"] in by_id:
            span = by_id[span["parent_id"]]
            chain.append(service[span["context"]["span_id"]])
        assert span["parent_id"] == f"0x{root_span}", f"span {span['name']} has an unknown parent"
        return chain

    for span in spans:
        chain = ancestors(span)
        if span["name"] == "kv-store put":
            assert chain[0] == "prefill-worker" and "router" in chain
        if span["name"] == "kv-store get":
            assert chain[0] == "decode-worker" and "router" in chain
    names = {s["name"] for s in spans}
    assert {"router request", "router.prefill", "router.decode", "kv-store put", "kv-store get", "kv.load"} <= names


def test_one_trace_per_request_reaches_an_otlp_collector_with_every_service_linked(mesh, otlp):
    """What Jaeger would get over OTLP/HTTP (protobuf, decoded with the OpenTelemetry package): the
    request's spans in one trace, rooted at the router's, each with its parent in the trace, from the
    router, the length predictor, the prefill worker (a KV put per layer, each parented on it), the
    kv-store and the decode worker (its engine's KV load)."""
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=60,
        headers=mesh.headers,
        json={"model": MODEL, "prompt": "Tell me about the tides. " * 60, "max_tokens": 4},
    )  # text:
    resp.raise_for_status()  # token-id prompts are not predicted
    request_id = resp.json()["id"]

    def trace() -> list[dict]:
        spans = otlp.spans()
        root = [s for s in spans if s["name"] == "router request" and s["attributes"].get("request.id") == request_id]
        return [s for s in spans if root and s["trace_id"] == root[0]["trace_id"]]

    def whole(spans: list[dict]) -> bool:  # a parent ends after its children, so may leave in a later batch
        ids = {s["span_id"] for s in spans}
        return needed <= {s["name"] for s in spans} and all(s["parent_id"] in ids for s in spans if s["parent_id"])

    give_up = time.monotonic() + 30  # spans leave in batches (every 5 s by default)
    needed = {
        "router request",
        "length-predictor predict",
        "prefill-worker prefill",
        "kv-store put",
        "decode-worker decode",
        "kv-store get",
        "kv.load",
    }
    while not whole(trace()) and time.monotonic() < give_up:
        time.sleep(0.2)
    spans = trace()
    assert needed <= {s["name"] for s in spans}, sorted({s["name"] for s in spans})
    assert not otlp.rejected
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if not s["parent_id"]]
    assert [r["name"] for r in roots] == ["router request"], [(r["name"], r["service"]) for r in roots]
    assert all(s["parent_id"] in by_id for s in spans if s["parent_id"]), "a span's parent is not in the trace"

    def services_above(span) -> list[str]:
        chain = []
        while span["parent_id"]:
            span = by_id[span["parent_id"]]
            chain.append(span["service"])
        return chain

    assert {"router", "length-predictor", "prefill-worker", "kv-store", "decode-worker"} <= {
        s["service"] for s in spans
    }
    prefill_puts = [s for s in spans if s["name"] == "kv-store put" and "prefill-worker" in services_above(s)]
    assert len(prefill_puts) >= NUM_LAYERS, len(prefill_puts)  # each layer's blocks as the layer is computed
    loads = [s for s in spans if s["name"] == "kv.load"]
    assert loads and all("decode-worker" in services_above(s) for s in loads)


def garbage_frames(rng: random.Random, n: int) -> list[bytes]:
    """Random bytes, and real messages cut inside their header (what a crashed or hostile peer sends)."""
    whole = [
        encode(m)
        for m in (
            KvDiscover(),
            LengthStatsRequest(),
            PlacementRequest(op="status"),
            LengthPredictRequest(prompt="x" * 50),
        )
    ]
    out = [rng.randbytes(rng.randint(0, 200)) for _ in range(n // 2)]
    out += [w[: rng.randint(0, 4 + int.from_bytes(w[:4], "big") - 1)] for w in rng.choices(whole, k=n - n // 2)]
    return out


def test_garbage_on_every_subject_crashes_nothing_leaks_no_request_and_the_mesh_stays_exact(mesh, reference):
    """Every subject the session mesh's services listen on gets random and truncated frames, as events
    and as requests: each request is answered with a typed bad_message, no service dies, no worker
    holds a request afterwards, and a greedy completion still equals the monolithic engine's."""
    prefill, decode = asyncio.run(live_worker(mesh, "prefill")), asyncio.run(live_worker(mesh, "decode"))
    replica = asyncio.run(length_stats(mesh)).replica
    health_before = httpx.get(f"{mesh.url}/health", timeout=5).json()
    answered = [
        Subjects.worker("prefill", prefill.worker_id),
        Subjects.worker("decode", decode.worker_id),
        Subjects.generate(decode.worker_id),
        Subjects.migrate(decode.worker_id),
        Subjects.migrate_in(decode.worker_id),
        Subjects.drain(prefill.worker_id),
        Subjects.drain(decode.worker_id),
        Subjects.kv_control(decode.worker_id),
        Subjects.LENGTH_PREDICT,
        Subjects.LENGTH_REMAINING,
        Subjects.LENGTH_REFIT,
        Subjects.length_stats(replica),
        Subjects.PLACEMENT,
        Subjects.activate(socket.gethostname()),
        Subjects.kv("0", "stats"),
        Subjects.kv("0", "flush"),
    ]
    events = [
        Subjects.HEARTBEAT,
        Subjects.abort(decode.worker_id),
        Subjects.abort(prefill.worker_id),
        Subjects.LENGTH_HEAD,
        Subjects.length_observed(replica),
        Subjects.KV_DISCOVER,
        Subjects.KV_SHARDS,
        Subjects.PLACEMENT_EVENTS,
        Subjects.TRAFFIC,
        Subjects.HOST_HEARTBEAT,
    ]
    rng = random.Random(7)

    async def send() -> dict[str, set[str]]:
        bus = await Bus.connect(mesh.nats_url, "test-garbage")
        codes: dict[str, set[str]] = {}
        try:
            for subject in answered + events:
                for data in garbage_frames(rng, 20):
                    await bus.nc.publish(subject, data)
            for subject in answered:
                for data in garbage_frames(rng, 4):
                    reply = await bus.nc.request(subject, data, timeout=10)
                    try:
                        decode_any(reply.data)
                        codes.setdefault(subject, set()).add("answered")
                    except MeshError as exc:
                        codes.setdefault(subject, set()).add(exc.code)
            await bus.nc.flush()
            return codes
        finally:
            await bus.close()

    codes = asyncio.run(send())
    assert all(found == {"bad_message"} for found in codes.values()), codes
    assert set(codes) == set(answered)
    time.sleep(2)  # every worker has beaten since
    assert mesh.launcher.alive() and httpx.get(f"{mesh.url}/health", timeout=5).json() == health_before
    for role, worker in (("prefill", prefill), ("decode", decode)):
        after = asyncio.run(live_worker(mesh, role, worker.worker_id))
        assert after is not None and after.running == 0 and after.state == "active", after
    asyncio.run(kv_stats(mesh))
    asyncio.run(length_stats(mesh))
    ids = token_prompt(300, seed=77)
    assert asyncio.run(disaggregated(mesh, ids)) == reference.generate(16, prompt_token_ids=ids)["token_ids"]


async def length_stats(mesh) -> LengthStats:
    """The stats of the length-predictor replica `make run` started (a prediction names it)."""
    bus = await Bus.connect(mesh.nats_url, "test-length")
    try:
        probe, _ = await bus.request(
            Subjects.LENGTH_PREDICT, LengthPredictRequest(prompt="probe"), LengthPrediction, timeout=30
        )
        stats, _ = await bus.request(
            Subjects.length_stats(probe.replica), LengthStatsRequest(), LengthStats, timeout=30
        )
        return stats
    finally:
        await bus.close()


def test_length_prediction_reaches_the_workers_and_the_actual_length_comes_back(mesh):
    before = asyncio.run(length_stats(mesh))
    trace_id = f"{random.getrandbits(128):032x}"
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=60,
        headers={**mesh.headers, "traceparent": f"00-{trace_id}-{f'{random.getrandbits(64):016x}'}-01"},
        json={"model": MODEL, "prompt": "Write a short poem about the sea. " * 120, "max_tokens": 6},
    )
    resp.raise_for_status()
    time.sleep(1)
    spans = {s["name"]: s for s in mesh.spans() if s["context"]["trace_id"] == f"0x{trace_id}"}
    router = spans["router request"]["attributes"]
    # Predicted beside the prefill of this long prompt (the test mesh samples every request), in before its end.
    assert router["length.prediction"] == "ok", router
    assert "length.bucket" not in spans["prefill-worker prefill"]["attributes"]  # the prefill did not wait for it
    assert spans["decode-worker decode"]["attributes"]["length.bucket"] == router["length.bucket"]
    assert spans["length-predictor predict"]["attributes"]["length.bucket"] == router["length.bucket"]
    # The worker that finished it reported its actual length back to the predictor.
    give_up = time.monotonic() + 10
    while True:
        after = asyncio.run(length_stats(mesh))
        reports = lambda s: s.censored + sum(b.observed for b in s.buckets)  # noqa: E731
        if reports(after) == reports(before) + 1 or time.monotonic() > give_up:
            break
        time.sleep(0.2)
    assert reports(after) == reports(before) + 1
    finish = resp.json()["choices"][0]["finish_reason"]
    assert after.censored == before.censored + (finish == "length")


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, status, code",
    [
        ("/v1/completions", b"{not json", 400, "invalid_request"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "invalid_request"),
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "invalid_request"),
        ("/v1/completions", {"model": MODEL}, 400, "invalid_request"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "invalid_request"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, 400, "invalid_request"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "seed": 2**63 - 1}, 400, "invalid_request"),
        ("/v1/completions", {"model": "no-such-model", "prompt": "hi"}, 404, "model_not_found"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": [5] * MAX_MODEL_LEN, "max_tokens": 8},
            400,
            "context_length_exceeded",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": [5] * 100, "max_tokens": MAX_MODEL_LEN},
            400,
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, "invalid_request"),
        # larger than a NATS message to a worker (make run's max_payload, 8 MB)
        ("/v1/completions", {"model": MODEL, "prompt": "a " * 4_500_000}, 413, "request_too_large"),
        ("/tokenize", {"model": MODEL, "prompt": "a " * 4_500_000}, 413, "request_too_large"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 1}}, 400, "invalid_request"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop_token_ids": [999999]}, 400, "invalid_request"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "cache_salt": ""}, 400, "invalid_request"),
        # vLLM refuses these structures when the request reaches it (the prefill worker's engine): a 400 still
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "(a"}},
            400,
            "invalid_request",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "structured_outputs": {"grammar": "root ::= nothing"}},
            400,
            "invalid_request",
        ),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "structured_outputs": {"json": {"type": "no-such-type"}}},
            400,
            "invalid_request",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": "a/b"},
            400,
            "invalid_request",
        ),
    ],
)
def test_bad_input_gets_openai_error(mesh, path, body, status, code):
    kwargs = (
        {"content": body, "headers": {**mesh.headers, "content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body, "headers": mesh.headers}
    )
    resp = httpx.post(f"{mesh.url}{path}", timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_context_error_through_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[5] * MAX_MODEL_LEN, max_tokens=8)


def test_decode_refuses_kv_from_a_different_layout(mesh):
    async def go():
        decode = await live_worker(mesh, "decode")
        bus = await Bus.connect(mesh.nats_url, "test-fingerprint")
        try:
            layout = {"block_size": 64, "model": MODEL}
            kv = KvHandle(fingerprint="0" * 32, block_size=64, block_hashes=[], num_tokens=0, kv_layout=layout)
            replies = await bus.stream(
                Subjects.worker("decode", decode.worker_id),
                DecodeRequest(
                    request_id="fp-mismatch",
                    model=MODEL,
                    prompt_token_ids=[1, 2, 3],
                    output_token_ids=[4],
                    sampling=SamplingOptions(max_tokens=2),
                    kv=kv,
                    fingerprint="0" * 32,
                    deadline=time.time() + 10,
                ),
                deadline=time.time() + 10,
            )
            with pytest.raises(KVFingerprintMismatch, match="block_size"):
                async for _ in replies:
                    pass
        finally:
            await bus.close()

    asyncio.run(go())


def test_a_decode_resumed_inside_a_character_shows_the_rest_of_the_text(mesh, tokenizer):
    """A leg that resumes after a character's first byte (the client was shown nothing for it) shows
    that byte's text with the next token: nothing lost, nothing repeated, not the prompt's text
    (vLLM's own detokenizer, given a prompt that ends inside a character, emits the whole prompt)."""
    first_byte = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")
    prompt, outputs = token_prompt(40, seed=5), [300, first_byte]

    async def go():
        decode = await live_worker(mesh, "decode")
        bus = await Bus.connect(mesh.nats_url, "test-detokenize")
        try:
            replies = await bus.stream(
                Subjects.worker("decode", decode.worker_id),
                DecodeRequest(
                    request_id="inside-a-character",
                    model=MODEL,
                    prompt_token_ids=prompt,
                    output_token_ids=outputs,
                    sampling=SamplingOptions(max_tokens=8, temperature=0, ignore_eos=True),
                    fingerprint=decode.fingerprint,
                    deadline=time.time() + 60,
                ),
                deadline=time.time() + 60,
            )
            return [delta async for delta, _ in replies]
        finally:
            await bus.close()

    deltas = asyncio.run(go())
    new = [t for d in deltas for t in d.token_ids]
    assert len(new) == 6
    shown_before = tokenizer.decode(outputs[:1])
    assert shown_before + "".join(d.text for d in deltas) == tokenizer.decode(outputs + new)


# ---- the other KV load mode ----------------------------------------------------------------------------------


def start_extra_worker(mesh, model_dir, role: str, worker_id: str, **env: str):
    """Another worker of the mesh's model beside the ones `make run` started (a fixture body)."""
    env = (
        {
            "MESH_NATS_URL": mesh.nats_url,
            "MESH_MODEL_DIR": str(model_dir),
            "MESH_WORKER_ID": worker_id,
            "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
            "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
        }
        | engine_cores().get(f"{role}-worker", {})
        | env
    )  # the cores `make run` gives the role
    with extra_workers(mesh):
        child = start_service(f"{role}-worker", env, mesh.logs / f"{worker_id}.log")
        try:
            give_up = time.monotonic() + 300
            while asyncio.run(live_worker(mesh, role, worker_id)) is None:
                assert child.alive() and time.monotonic() < give_up, f"{worker_id} did not start"
            yield worker_id
        finally:
            child.stop()


@pytest.fixture
def async_decode_worker(mesh, model_dir):
    """A second decode worker that loads all layers before scheduling the request (`async`)."""
    yield from start_extra_worker(mesh, model_dir, "decode", "decode-async", MESH_KV_LOAD_MODE="async")


async def disaggregated(
    mesh,
    ids: list[int],
    max_tokens: int = 16,
    decode_worker: str | None = None,
    between=None,
    prefill_worker: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Prefill then decode over the bus, as the router does, with `between()` run in the middle."""
    prefill_worker = prefill_worker or (await live_worker(mesh, "prefill")).worker_id
    decode_worker = decode_worker or (await live_worker(mesh, "decode")).worker_id
    request_id = f"direct-{random.getrandbits(32):x}"
    bus = await Bus.connect(mesh.nats_url, "test-direct")
    try:
        # what a slow machine needs (on an AVX2-only CPU with bf16 engines, the suite's twelve 1000 -> 1000 token
        # requests at once on one decode worker took over a minute)
        deadline = time.time() + DIRECT_DEADLINE_S
        sampling = SamplingOptions(max_tokens=max_tokens, temperature=0)
        result, _ = await bus.request(
            Subjects.worker("prefill", prefill_worker),
            PrefillRequest(
                request_id=request_id,
                model=MODEL,
                prompt_token_ids=ids,
                sampling=sampling,
                deadline=deadline,
                cache_salt=cache_salt,
            ),
            PrefillResult,
            timeout=DIRECT_DEADLINE_S,
        )
        if between is not None:
            await between()
        tokens = list(result.first.token_ids)
        replies = await bus.stream(
            Subjects.worker("decode", decode_worker),
            DecodeRequest(
                request_id=request_id,
                model=MODEL,
                prompt_token_ids=result.prompt_token_ids,
                output_token_ids=tokens[:1],
                sampling=sampling,
                kv=result.kv,
                fingerprint=result.fingerprint,
                deadline=deadline,
                cache_salt=cache_salt,
            ),
            deadline=deadline,
        )
        async for delta, _ in replies:
            tokens += delta.token_ids
        return tokens
    finally:
        await bus.close()


async def generated_on_decode(mesh, ids: list[int], max_tokens: int = 16) -> list[int]:
    """A whole request on the decode worker (what the router does when prefill is backed up)."""
    decode_worker = (await live_worker(mesh, "decode")).worker_id
    bus = await Bus.connect(mesh.nats_url, "test-generate")
    try:
        tokens = []
        replies = await bus.stream(
            Subjects.generate(decode_worker),
            PrefillRequest(
                request_id=f"whole-{random.getrandbits(32):x}",
                model=MODEL,
                prompt_token_ids=ids,
                sampling=SamplingOptions(max_tokens=max_tokens, temperature=0),
                deadline=time.time() + 60,
            ),
            deadline=time.time() + 60,
        )
        async for delta, _ in replies:
            tokens += delta.token_ids
        return tokens
    finally:
        await bus.close()


def test_a_whole_request_on_the_decode_worker_is_exact_and_stores_its_prompt(mesh, reference):
    ids = token_prompt(450, seed=4545)  # 3 full blocks
    before = asyncio.run(kv_stats(mesh))
    assert asyncio.run(generated_on_decode(mesh, ids)) == reference.generate(16, prompt_token_ids=ids)["token_ids"]
    give_up = time.monotonic() + 10  # written behind, not waited for
    while (puts := asyncio.run(kv_stats(mesh)).puts - before.puts) < 3 * NUM_LAYERS and time.monotonic() < give_up:
        time.sleep(0.2)
    assert puts >= 3 * NUM_LAYERS  # its prompt's full blocks, for the next turn's prefill


def test_async_load_mode_is_exact_too(mesh, reference, async_decode_worker):
    ids = token_prompt(700, seed=77)
    before = asyncio.run(kv_stats(mesh))
    tokens = asyncio.run(disaggregated(mesh, ids, decode_worker=async_decode_worker))
    assert tokens == reference.generate(16, prompt_token_ids=ids)["token_ids"]
    after = asyncio.run(kv_stats(mesh))
    assert after.hits - before.hits == 6 * NUM_LAYERS and after.misses == before.misses  # 700 tokens: 6 blocks


# ---- KV from the SSD tier -------------------------------------------------------------------------------------


def kv_store_pid(mesh) -> int | None:
    return next((pid for pid in descendants(mesh.launcher.pid) if "llmesh_kvstore" in cmdline(pid)), None)


@pytest.fixture(scope="module")
def replacement_kv_store(mesh):
    """Kill the mesh's kv-store abruptly; the launcher starts it again on the same data directory."""

    async def restart():
        killed = kv_store_pid(mesh)
        os.killpg(killed, signal.SIGKILL)
        give_up = time.monotonic() + 30
        while True:
            try:  # (briefly, the dying store's subscription may still take the request)
                if kv_store_pid(mesh) not in (killed, None):
                    return await kv_stats(mesh, timeout=2)
            except MeshError:
                pass
            assert time.monotonic() < give_up, "the kv-store was not started again, or does not answer"
            await asyncio.sleep(0.2)

    return restart


def test_kv_read_from_ssd_after_demotion_and_after_a_store_restart_is_exact(mesh, reference, replacement_kv_store):
    ids = token_prompt(600, seed=901)  # 5 blocks
    before = asyncio.run(kv_stats(mesh))
    spilled = []

    async def spill():
        spilled.append(await kv_stats(mesh, "flush"))

    expected = reference.generate(16, prompt_token_ids=ids)["token_ids"]
    assert asyncio.run(disaggregated(mesh, ids, between=spill)) == expected
    after = asyncio.run(kv_stats(mesh))
    assert spilled[0].chunks == 0 and spilled[0].ssd_chunks >= 5 * NUM_LAYERS
    assert after.ssd_hits - before.ssd_hits == 5 * NUM_LAYERS and after.misses == before.misses

    ids = token_prompt(900, seed=902)  # 8 blocks

    async def spill_and_restart():
        await kv_stats(mesh, "flush")
        restarted = await replacement_kv_store()
        assert restarted.chunks == 0 and restarted.ssd_chunks >= 8 * NUM_LAYERS  # re-indexed from disk

    assert (
        asyncio.run(disaggregated(mesh, ids, between=spill_and_restart))
        == reference.generate(16, prompt_token_ids=ids)["token_ids"]
    )
    after = asyncio.run(kv_stats(mesh))
    assert after.ssd_hits == 8 * NUM_LAYERS and after.misses == 0


def test_heartbeats_carry_each_running_request_and_kv_blocks_for_the_policies(mesh):
    """What the dispatch policies read: a streaming request appears on the decode worker's
    heartbeats with its prompt, its progress, the KV blocks it fills and the length predictor's
    estimate of its remaining output, refined as tokens arrive (every MESH_LENGTH_REFINE_EVERY)."""

    async def go():
        bus = await Bus.connect(mesh.nats_url, "test-heartbeats")
        seen: list[WorkerInfo] = []

        async def on_heartbeat(info, blob):
            if info.role == "decode" and info.requests:
                seen.append(info)

        try:
            await bus.serve(Subjects.HEARTBEAT, on_heartbeat, traced=False)
            async with httpx.AsyncClient(timeout=60, headers=mesh.headers) as http:
                async with http.stream(
                    "POST",
                    f"{mesh.url}/v1/completions",
                    json={
                        "model": MODEL,
                        "prompt": "Tell me a long story " * 20,
                        "max_tokens": 6000,
                        "ignore_eos": True,
                        "stream": True,
                        "priority": -2,
                    },
                ) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():
                        assert not line.startswith('data: {"error"'), line
        finally:
            await bus.close()
        assert seen, "no decode heartbeat showed the request while it ran"
        for info in seen:
            assert info.kv_blocks_total > 0 and info.block_size > 0
            assert len(info.requests) == info.running == 1
            held = info.requests[0]
            assert held.prompt_tokens > 100 and held.max_tokens == 6000 and 1 <= held.generated < 6000
            assert held.priority == -2
            assert info.kv_blocks_used == -(-(held.prompt_tokens + held.generated) // info.block_size)
        assert len({info.requests[0].generated for info in seen}) == len(seen)  # progress, not a fixed number
        refined = {
            (r.remaining_at, r.predicted_remaining)
            for r in (info.requests[0] for info in seen)
            if r.predicted_remaining is not None
        }
        assert all(at >= 64 and remaining > 0 for at, remaining in refined), refined
        assert len(refined) >= 2, f"the refined estimate did not change as tokens arrived: {refined}"

    asyncio.run(go())


# ---- faults (last: they kill the decode worker) ------------------------------------------------------------


def test_client_disconnect_aborts_the_request_in_the_worker(mesh):
    async def go():
        async with httpx.AsyncClient(timeout=30, headers=mesh.headers) as http:
            async with http.stream(
                "POST",
                f"{mesh.url}/v1/completions",
                json={"model": MODEL, "prompt": "Tell me everything", "max_tokens": 1500, "stream": True},
            ) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data:"):
                        break  # the first token arrived: hang up
        give_up = time.monotonic() + 5
        while time.monotonic() < give_up:
            if (await live_worker(mesh, "decode")).running == 0:
                return
        pytest.fail("the decode worker still runs the request 5 s after the client left")

    asyncio.run(go())


def launchers_worker(mesh, role: str) -> WorkerInfo:
    """The next heartbeat of a `role` worker the launcher started (named `<role>-<host>-<pid>`), not one a
    host agent made of a standby."""
    pids = {str(pid) for pid in launched(mesh)}
    for _ in range(10):
        info = asyncio.run(live_worker(mesh, role))
        if info is not None and info.worker_id.rsplit("-", 1)[1] in pids:
            return info
    raise AssertionError(f"no heartbeat of a {role} worker among the launcher's processes {sorted(pids)}")


@pytest.mark.breaks_the_mesh  # kills the mesh's only decode worker (the launcher starts it again)
def test_a_stream_whose_only_decode_worker_dies_waits_for_its_restart_and_ends(client, mesh):
    """Nothing is lost while the model has no decode worker: the stream in flight, and a request that
    arrives meanwhile, wait for the launcher's restart of the worker (MESH_MODEL_WAIT_S) and finish."""
    decode = launchers_worker(mesh, "decode")
    pid = int(decode.worker_id.rsplit("-", 1)[1])
    stream = client.completions.create(
        model=MODEL, prompt="Count slowly", max_tokens=200, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    killed_at = time.monotonic()
    os.killpg(pid, signal.SIGKILL)  # the worker and its engine process, abruptly
    last = list(chunks)[-1]
    ended_after = time.monotonic() - killed_at
    assert last.choices[0].finish_reason == "length", last  # all 200 tokens: an error would have raised
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 4},
        timeout=120,
        headers=mesh.headers,
    )
    assert resp.status_code == 200, resp.text
    restarted = asyncio.run(live_worker(mesh, "decode"))
    assert restarted is not None and restarted.worker_id != decode.worker_id
    print(f"the stream resumed and ended {ended_after:.1f} s after its decode worker was killed")


@pytest.mark.ends_the_mesh
def test_ctrl_c_on_make_run_leaves_no_process_behind(mesh):
    """What a user's Ctrl-C does: SIGINT to the foreground process group of `make run`."""
    tree = descendants(mesh.launcher.pid)
    assert len(tree) >= 5  # the launcher, nats, kv-store, prefill worker and engine, router...
    os.killpg(mesh.launcher.pid, signal.SIGINT)
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up and any(alive(p) for p in tree):
        time.sleep(0.2)
    assert not [p for p in tree if alive(p)], "processes left after Ctrl-C"
