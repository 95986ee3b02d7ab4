"""schemathesis over the router's own OpenAPI schema, against the session mesh (real engines): valid
and invalid requests to every endpoint, streaming and not, get no 5xx, no hang, and every error in
OpenAI's shape. Generated requests ask for at most 32 tokens, 2 choices and 2 prompts (the suite's time) and name
the served model half the time, so that valid ones reach the engines (how many depends on hypothesis's draws:
the router's own checks refuse most generated bodies)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from .test_mesh import MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
# (named to run after test_bench_serve.py, which needs the machine before the session mesh starts)
OPERATIONS = [
    ("POST", "/v1/completions", 40),
    ("POST", "/v1/chat/completions", 40),
    ("POST", "/v1/responses", 20),
    ("GET", "/v1/responses/{response_id}", 3),
    ("DELETE", "/v1/responses/{response_id}", 3),
    ("POST", "/tokenize", 20),
    ("POST", "/detokenize", 10),
    ("GET", "/v1/models", 10),
    ("GET", "/health", 5),
    ("GET", "/metrics", 5),
]
MAX_TOKENS = 32
MAX_CHOICES = 2
MAX_PROMPTS = 2  # of a completion's list of them


@pytest.fixture(scope="module")
def schema(mesh):
    loaded = schemathesis.openapi.from_url(f"{mesh.url}/openapi.json")
    loaded.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    # schemathesis stops reading a stream after 20 events by default, and the router rightly takes
    # the closed connection as a client that left (499, the request aborted): read every event
    loaded.config.max_stream_events = MAX_PROMPTS * MAX_CHOICES * MAX_TOKENS + 8
    return loaded


def number(value) -> float | None:
    """`value` as a number, where the router's validation reads one (an int, a float, a numeric string)."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError, OverflowError):
        return None


def bounded(case, served: bool):
    """The case asking for at most MAX_TOKENS tokens, MAX_CHOICES choices and MAX_PROMPTS prompts (invalid
    values are left for the router to refuse)."""
    if isinstance(case.body, dict):
        limits = [("max_tokens", MAX_TOKENS), ("max_completion_tokens", MAX_TOKENS), ("n", MAX_CHOICES)]
        if case.path == "/v1/responses":
            limits = [("max_output_tokens", MAX_TOKENS)]
        for field, most in limits:
            value = case.body.get(field)
            if (value is None and field != "n") or (number(value) or 0) > most:
                case.body[field] = most
        prompt = case.body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            case.body["prompt"] = prompt[:MAX_PROMPTS]
        if served:
            case.body["model"] = MODEL
    return case


def assert_openai_error(response) -> None:
    body = response.json()
    error = body.get("error") if isinstance(body, dict) else None
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str)


@pytest.mark.parametrize("method, path, examples", OPERATIONS)
def test_any_request_gets_an_answer_without_a_5xx_and_errors_in_openais_shape(mesh, schema, method, path, examples):
    operation = schema[path][method]
    statuses: list[int] = []

    @given(st.tuples(operation.as_strategy(), st.booleans()))
    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(drawn):
        case = bounded(*drawn)
        response = case.call(headers=mesh.headers, timeout=90)  # no hang: the router's deadline is 120 s
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert_openai_error(response)
        elif method == "POST" and isinstance(case.body, dict) and case.body.get("stream") is True:
            assert not response.stream_cut_short, "the client stopped reading"
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events, response.text[-500:]
            if path == "/v1/responses":  # typed events, the last the response's end
                ends = {"response.completed", "response.incomplete", "response.failed"}
                assert json.loads(events[-1])["type"] in ends, response.text[-500:]
            elif events[-1] != "[DONE]":  # a stream that failed midway ends with an OpenAI error event
                assert set(json.loads(events[-1])) == {"error"}, response.text[-500:]

    check()
    print(f"{method} {path}: statuses {sorted(Counter(statuses).items())}")  # how many reached the engines
