"""Several models in one mesh (issue 33): the session's mesh has two in its catalogue (MESH_MODELS) and
workers for the first only, so `make run` also starts a host agent with pre-started processes. A request
for the second waits; the router's traffic shows it parked, placement activates the model on the host
(Prism's Algorithm 1 over the host agents), the agent turns a standby into the model's worker (the second
is served aggregated: one decode worker running whole requests), and the requests are answered. Each
model then answers as its own monolithic engine (the disaggregated one exactly, the aggregated one but
for batching's near-ties), its requests mixed with the other's; drained,
the second model's workers exit (the agent starts new standbys meanwhile). The second model's catalogue
entry names a reasoning parser: its chats are read into reasoning and content as vLLM's server reads its
monolithic engine's, a structured output waits for the reasoning's end as there, and a thinking budget
forces its end as there."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from llmesh.engine.models import resolve_model
from llmesh.wire.messages import PlacementRequest, PlacementStatus, Subjects

from .conftest import MODEL_B, assert_echoed_as_vllm, extra_workers, reference_engine
from .test_live_migration import NEAR_TIE, command
from .test_mesh import MODEL, token_prompt

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


REASONING_PARSER = "deepseek_r1"  # the second model's (conftest.CATALOGUE)
THINK_START, THINK_END = 2000, 2001  # `<think>`, `</think>` in the embedded tokenizer (llmesh.engine.models)


def assert_reasoning_read_as_vllms_server_reads_it(client, reference, model_path: str) -> None:
    """A chat for a model with a reasoning parser, alone in its engine's batch (exact): the reasoning and
    the content, whole and streamed, and the reasoning tokens, are what vLLM's parser reads of the monolithic
    engine's output; a structured output is constrained from the reasoning's end on (or from the start
    where the reasoning is not shown), as by vLLM's engine with the parser."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model_path)
    chat, ids, bias = _chat_ending_reasoning_midway(reference, tokenizer, 20)
    regex = "[a-z]{4,12}"
    parser_class = ParserManager.get_parser(reasoning_parser_name=REASONING_PARSER, tokenizer=tokenizer)
    for extra, reference_args in (
        ({}, {}),
        ({"structured_outputs": {"regex": regex}}, {"structured_outputs": {"regex": regex}}),
        (
            {"structured_outputs": {"regex": regex}, "include_reasoning": False},
            {"structured_outputs": {"regex": regex}, "reasoning_ended": True},  # (vLLM's server's then)
        ),
    ):
        asked = {
            "model": MODEL_B,
            "messages": chat,
            "max_tokens": 20,
            "temperature": 0,
            "logit_bias": bias,
            "extra_body": {"return_token_ids": True} | extra,
        }
        expected = reference.generate(20, prompt_token_ids=ids, logit_bias=bias, **reference_args)
        request = ChatCompletionRequest(model=MODEL_B, messages=chat, **extra)
        parser = parser_class(tokenizer, None)
        reasoning, content, _ = parser.parse(expected["text"], request, False, expected["token_ids"])
        reasoning = reasoning if request.include_reasoning else None
        whole = client.chat.completions.create(**asked)
        answer = whole.choices[0]
        shown = (getattr(answer.message, "reasoning", None), answer.message.content)
        assert shown == (reasoning, content), (extra, expected["text"])
        assert whole.usage.completion_tokens_details.reasoning_tokens == parser.count_reasoning_tokens(
            expected["token_ids"]
        )
        if request.include_reasoning:
            assert answer.token_ids == expected["token_ids"], extra
        else:
            assert getattr(answer, "token_ids", None) is None  # (they would show the reasoning)
        streamed = {"reasoning": "", "content": ""}
        for chunk in client.chat.completions.create(**asked, stream=True):
            for field in streamed:
                streamed[field] += getattr(chunk.choices[0].delta, field, None) or ""
        assert (streamed["reasoning"] or None, streamed["content"] or None) == (reasoning, content or None), extra
        tokens = expected["token_ids"]
        if "structured_outputs" not in extra:
            assert 0 < tokens.index(THINK_END) < len(tokens) - 1  # (a test of both parts)
            assert_response_items_read_so(
                client, {"input": chat, "logit_bias": bias}, reasoning, content, parser, tokens
            )
        elif request.include_reasoning:  # unconstrained till the reasoning's end, then the regex
            end = tokens.index(THINK_END)
            content_text = tokenizer.decode(tokens[end + 1 :], skip_special_tokens=True)  # (its end: EOS)
            assert re.fullmatch(regex, content_text) and end > 0, expected["text"]
        else:
            assert re.fullmatch(regex, expected["text"])


QUESTIONS = ("What is two and two?", "Name a colour.", "Why is the sky blue?", "Count to three.", "Say hello.")


def _chat_ending_reasoning_midway(reference, tokenizer, tokens: int) -> tuple[list[dict], list[int], dict[str, float]]:
    """A chat, its prompt's ids (as vLLM's server encodes a chat) and a logit bias that lifts `</think>` above the
    random model's other tokens somewhere inside its first `tokens` (greedy, by the monolithic engine), neither
    first nor last. Where a bias ends the reasoning depends on the CPU's kernels (bf16 computed natively or
    emulated: seen, one prompt's reasoning ended at the last token under a bias of 5.0 and at the first under 5.25
    on one machine, in the middle under 5 on another), so it is found: for each question in turn, the bias raised
    until the reasoning ends within `tokens`, then bisected."""
    tried = {}
    for question in QUESTIONS:
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        ends = tried[question] = {}  # bias -> where the reasoning ended (`tokens`: not within them)

        def end(lift: float, ids: list[int] = ids) -> int:
            out = reference.generate(tokens, prompt_token_ids=ids, logit_bias={str(THINK_END): lift})["token_ids"]
            return out.index(THINK_END) if THINK_END in out else tokens

        late, early = 0.0, 1.0
        while ends.setdefault(early, end(early)) >= tokens - 1 and early < 64:
            late, early = early, early * 2
        for _ in range(12):
            if 0 < ends[early] < tokens - 1:
                return chat, ids, {str(THINK_END): early}
            middle = (late + early) / 2
            if ends.setdefault(middle, end(middle)) >= tokens - 1:
                late = middle
            else:
                early = middle
    pytest.fail(f"no question and logit bias on </think> end the reasoning inside {tokens} tokens: {tried}")


def assert_response_items_read_so(client, asked: dict, reasoning: str, content: str, parser, tokens: list[int]) -> None:
    """The same request to /v1/responses, whole and streamed: a reasoning item and a message of what the parser
    read, and the reasoning's tokens in the usage."""
    fields = {"model": MODEL_B, "max_output_tokens": 20, "temperature": 0, "input": asked["input"]}
    whole = client.responses.create(**fields, extra_body={"logit_bias": asked["logit_bias"]})
    thought, said = whole.output
    assert (thought.type, thought.content[0].text, said.type, whole.output_text) == (
        "reasoning",
        reasoning,
        "message",
        content,
    )
    assert whole.usage.output_tokens_details.reasoning_tokens == parser.count_reasoning_tokens(tokens)
    events = list(client.responses.create(**fields, stream=True, extra_body={"logit_bias": asked["logit_bias"]}))
    joined = {
        kind: "".join(e.delta for e in events if e.type == kind)
        for kind in ("response.reasoning_text.delta", "response.output_text.delta")
    }
    assert joined == {"response.reasoning_text.delta": reasoning, "response.output_text.delta": content}
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]


def assert_thinking_budget_kept_as_vllms_engine_keeps_it(client, reference, prompt: list[int]) -> None:
    """`thinking_token_budget` on a model with a reasoning parser: a prompt that opens the reasoning gets its
    end forced after that many tokens, as by vLLM's engine with the parser (the random model never ends it
    itself); a model without a parser refuses a budget, as vLLM's engine does."""
    opened = [*prompt, THINK_START]
    for budget in (0, 4):
        got = client.completions.create(
            model=MODEL_B,
            prompt=opened,
            max_tokens=10,
            temperature=0,
            extra_body={"thinking_token_budget": budget, "return_token_ids": True},
        )
        expected = reference.generate(10, prompt_token_ids=opened, thinking_token_budget=budget)["token_ids"]
        assert got.choices[0].token_ids == expected and expected[budget] == THINK_END, (budget, expected)
    with pytest.raises(openai.BadRequestError, match="reasoning_config is not configured"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"thinking_token_budget": 2})


def complete(mesh, model: str, ids: list[int], max_tokens: int = 16) -> list[int]:
    resp = httpx.post(
        f"{mesh.url}/v1/completions",
        timeout=130,
        headers=mesh.headers,
        json={"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True},
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def placement(mesh, **request) -> PlacementStatus:
    return asyncio.run(command(mesh.nats_url, Subjects.PLACEMENT, PlacementRequest(**request), PlacementStatus))


def pool_ready(mesh) -> PlacementStatus | None:
    """Placement's status once the host agent reports a ready standby of each role and no worker."""
    status = placement(mesh, op="status")
    ready = status.hosts and status.hosts[0].standbys == {"prefill": 1, "decode": 1} and not status.hosts[0].workers
    return status if ready else None


def what_happened(mesh, status: PlacementStatus) -> str:
    """Placement's decisions and the logs' lines on workers lost, exited or forgotten: why a model was
    activated that the test did not ask for (in CI once: both of the first model's workers were gone)."""
    lines = [f"{e.kind} {e.reason}: {e.detail}" for e in status.events]
    for log, words in (
        (mesh.launcher.log_path, ("exited",)),
        (mesh.logs / "router.log", ("dropped", "since its last heartbeat")),
        (mesh.logs / "placement.log", ("forgotten", "evict", "drain", "activate")),
    ):
        text = log.read_text(errors="replace") if log and log.exists() else ""
        lines += [f"{log.name}: {line}" for line in text.splitlines() if any(w in line for w in words)]
    return "\n".join(lines[-60:])


def wait_for(predicate, timeout: float, what: str):
    give_up = time.monotonic() + timeout
    while not (found := predicate()):
        assert time.monotonic() < give_up, what
        time.sleep(0.5)
    return found


def test_a_model_no_worker_serves_is_activated_by_placement_and_each_model_answers_as_its_own_engine(
    mesh, model_dir, reference, tmp_path
):
    listed = httpx.get(f"{mesh.url}/v1/models", headers=mesh.headers, timeout=10).json()["data"]
    assert [m["id"] for m in listed] == [MODEL, MODEL_B]
    prompts = [token_prompt(n, seed=3300 + n) for n in (40, 300, 700)]
    wait_for(lambda: pool_ready(mesh), 180, "the host agent's standbys did not get ready")
    path_b = resolve_model("llmesh/tiny-llama-b", model_dir)
    with (
        reference_engine(path_b, tmp_path, reasoning_parser=REASONING_PARSER) as reference_b,
        extra_workers(mesh, timeout=60),
        ThreadPoolExecutor(6) as pool,
    ):
        # first, so that the reference engine's start (it starts at its first question) does not take the
        # cores from the activation timed below
        expected_b = [reference_b.generate(16, prompt_token_ids=ids)["token_ids"] for ids in prompts]
        asked = time.monotonic()
        first = [f.result(timeout=130) for f in [pool.submit(complete, mesh, MODEL_B, ids) for ids in prompts]]
        served_after = time.monotonic() - asked
        mixed = [pool.submit(complete, mesh, model, ids) for ids in prompts for model in (MODEL, MODEL_B)]
        mixed_out = [f.result(timeout=130) for f in mixed]
        outputs_b = first + mixed_out[1::2]
        parted_b = [(ids, out) for ids, out, solo in zip(prompts * 2, outputs_b, expected_b * 2) if out != solo]
        gaps_b = [max(reference_b.greedy_gaps(ids, out)) for ids, out in parted_b]
        alone_b = complete(mesh, MODEL_B, prompts[2])
        client = openai.OpenAI(base_url=f"{mesh.url}/v1", api_key=mesh.api_key, max_retries=0, timeout=60)
        echo_b = client.completions.create(  # the prompt's logprobs from a decode worker running the request whole
            model=MODEL_B, prompt=prompts[1], max_tokens=1, temperature=0, echo=True, logprobs=2
        )
        expected_echo_b = reference_b.generate(1, prompt_token_ids=prompts[1], prompt_logprobs=2, logprobs=2)
        assert_reasoning_read_as_vllms_server_reads_it(client, reference_b, path_b)
        assert_thinking_budget_kept_as_vllms_engine_keeps_it(client, reference_b, prompts[0])
        status = placement(mesh, op="status")
        b_workers = [w.worker_id for w in status.workers if w.model == MODEL_B]
        for worker_id in b_workers:  # evicted by hand: drained, they exit
            assert "drains" in placement(mesh, op="drain", worker_id=worker_id).message
    expected_a = [reference.generate(16, prompt_token_ids=ids)["token_ids"] for ids in prompts]
    activations = [e.detail for e in status.events if e.kind == "activate"]
    print(f"the requests for {MODEL_B} were answered {served_after:.1f} s after they were sent: {activations}")
    assert expected_a != expected_b  # otherwise this test could not tell the models apart
    assert mixed_out[::2] == expected_a  # disaggregated: exact
    # The aggregated model's worker runs its requests' prompts and decodes in one batch, as a monolithic
    # engine under load does, and vLLM is not batch-invariant: an output may part from the solo run's at a
    # near-tie (in CI at 9fafdeb, 1 of 3 after 9 tokens), never by more.
    print(f"{len(parted_b)} of {len(outputs_b)} outputs for {MODEL_B} parted from its solo engine's: gaps {gaps_b}")
    assert max(gaps_b, default=0) <= NEAR_TIE, gaps_b
    assert alone_b == expected_b[2]  # alone in its batch: exact
    assert_echoed_as_vllm(echo_b.choices[0], expected_echo_b, top=2)
    assert [(a["model"], a["role"], a["outcome"], a["how"]) for a in activations] == [
        (MODEL_B, "decode", "accepted", "from a standby")
    ], what_happened(mesh, status)
    assert sorted(b_workers) == sorted(a["worker_id"] for a in activations)
    # placement split the host's budget: what a's engines leave, less b's engine's weights (a's: same
    # shape), all for it; its KV space is that, in whole blocks
    a_engines = [w for w in status.workers if w.model == MODEL]
    free = status.hosts[0].memory_bytes - sum(w.memory_bytes for w in a_engines) - a_engines[0].weights_bytes
    given = {a["worker_id"]: a["kv_cache_bytes"] for a in activations}
    assert all(abs(kv - free) <= 1 for kv in given.values()), (given, free)
    for w in status.workers:
        if w.model == MODEL_B:
            assert given[w.worker_id] - 2**20 < w.memory_bytes - w.weights_bytes <= given[w.worker_id]
    drained = lambda: not placement(mesh, op="status").hosts[0].workers  # noqa: E731
    wait_for(drained, 60, "the drained workers did not exit, or the host agent did not notice")
