"""One real mesh per test session (the launcher `make run` uses) and a monolithic reference engine."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
from otlp_receiver import OtlpReceiver

from llmesh.deploy.credentials import EVERYTHING, load_or_create
from llmesh.deploy.launcher import Child, free_port, wait_healthy
from llmesh.engine.models import resolve_model
from llmesh.wire.config import EMBEDDED_MODEL
from llmesh.wire.secrets import MeshSecrets

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 8192  # a long context makes long requests: the tiny model decodes 2k tokens in about a second
BLOCK_SIZE = 128
STARTUP_S = 420
MODEL_B = "tiny-b"  # in the catalogue of the session's mesh, served by no worker it starts (placement activates it)
# served aggregated: placement activates a decode worker alone, which runs its requests whole. The first
# reads tool calls in vLLM's pythonic format (tool_choice "auto"); the second has no tool-call parser, and
# reads reasoning as DeepSeek-R1's (`<think>`, `</think>`: the embedded tokenizer has them).
CATALOGUE = [
    {"name": EMBEDDED_MODEL, "tool_call_parser": "pythonic"},
    {"name": MODEL_B, "model": "llmesh/tiny-llama-b", "disaggregated": False, "reasoning_parser": "deepseek_r1"},
]


class Mesh:
    def __init__(self, url: str, nats_url: str, work: Path, launcher: Child, secrets: MeshSecrets):
        """`nats_url` carries the test harness's NATS user (it plays every part: router, placement,
        workers); `headers` the API key."""
        self.url, self.launcher, self.secrets = url, launcher, secrets
        self.nats_url = secrets.nats_url(nats_url, "harness")
        self.api_key = secrets.api_key
        self.headers = {"Authorization": f"Bearer {secrets.api_key}"}
        self.trace_dir, self.logs, self.kv_data = work / "traces", work / "logs", work / "kv-data"

    def spans(self) -> list[dict]:
        out = []
        for path in self.trace_dir.glob("*.jsonl"):
            out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return Path(os.environ.get("MESH_TEST_MODEL_DIR") or tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def model_path(model_dir) -> str:
    return resolve_model(EMBEDDED_MODEL, model_dir)  # built once, before any process needs it


@contextmanager
def running_mesh(work: Path, model_dir: Path, command: list[str], **env: str) -> Iterator[Mesh]:
    """A whole mesh started by `command` (the launcher) with its state under `work`."""
    port, nats_port, redis_port = free_port(), free_port(), free_port()
    secrets = load_or_create(work / "secrets", extra_users={"harness": EVERYTHING})
    env = {
        "MESH_SECRETS_DIR": str(work / "secrets"),
        "MESH_PORT": str(port),
        "MESH_NATS_PORT": str(nats_port),
        "MESH_REDIS_PORT": str(redis_port),
        "MESH_LOG_DIR": str(work / "logs"),
        "MESH_MODEL_DIR": str(model_dir),
        "MESH_DATA_DIR": str(work / "kv-data"),
        "MESH_TRACE_DIR": str(work / "traces"),
        "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
        "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
        "MESH_REQUEST_TIMEOUT_S": "120",
        # a request waits for room up to 100 s (within its timeout) rather than the 10 s before a 429: where the
        # engines emulate bf16 (AVX2 alone), sixteen requests at once were refused after an estimated wait
        "MESH_QUEUE_MAX_WAIT_S": "100",
        "MESH_LENGTH_PREDICT_TIMEOUT_S": "10",  # the predictor shares 2 cores with two engines here
        "MESH_LENGTH_SAMPLE_FRACTION": "1",  # every request predicted (beside its prefill)
        "MESH_PLACEMENT_BALANCE": "0",  # tests that place requests themselves; drains still migrate
    } | env
    work.mkdir(parents=True, exist_ok=True)
    launcher = Child("mesh", command, env=env, log_path=work / "launcher.log")
    mesh = Mesh(f"http://127.0.0.1:{port}", f"nats://127.0.0.1:{nats_port}", work, launcher, secrets)
    try:
        wait_healthy(mesh.url, STARTUP_S, [launcher])
        yield mesh
    finally:
        launcher.stop(30)


def launched(mesh: Mesh) -> dict[int, str]:
    """pid -> program of every process the mesh's launcher started (its tree, not names)."""
    root = psutil.Process(mesh.launcher.pid)
    return {p.pid: " ".join(p.cmdline()[:3]) for p in root.children(recursive=True)}


def router_workers(url: str) -> dict[str, int]:
    """Live workers by role, as the router at `url` counts them."""
    return httpx.get(f"{url}/health", timeout=5).json()["workers"]


@contextmanager
def extra_workers(mesh: Mesh, timeout: float = 30) -> Iterator[None]:
    """Around a fixture that starts workers beside the mesh's and stops or kills them: afterwards,
    waits until the mesh's router counts no more workers of any role than before (a stopped worker
    stays counted until it misses its heartbeats), so later tests see the mesh as it was."""
    before = router_workers(mesh.url)
    try:
        yield
    finally:
        give_up = time.monotonic() + timeout
        while mesh.launcher.alive():
            now = router_workers(mesh.url)
            if all(n <= before.get(role, 0) for role, n in now.items()):
                break
            assert time.monotonic() < give_up, f"the router still counts {now} workers, {before} before"
            time.sleep(0.2)


def pytest_collection_modifyitems(items):
    """Tests that start engines of their own run first, before the session's mesh starts (its engines
    and theirs together would not fit this machine's memory: the kernel killed one once). Tests that stop
    the session's mesh or kill its decode worker run after every other e2e test (before the rest, which
    do not need the engines' memory and CPU), in their own order, and the one that ends it after them all
    (whatever order the files were named in)."""
    first = [item for item in items if item.get_closest_marker("own_engines")]
    ending = [item for item in items if item.get_closest_marker("ends_the_mesh")]
    last = [item for item in items if item.get_closest_marker("breaks_the_mesh") and item not in ending] + ending
    rest = [item for item in items if item not in first and item not in last]
    at = 1 + max((k for k, item in enumerate(rest) if item.get_closest_marker("e2e")), default=len(rest) - 1)
    items[:] = first + rest[:at] + last + rest[at:]


@pytest.fixture(scope="session")
def otlp():
    """Where the session mesh's services export their spans over OTLP/HTTP."""
    receiver = OtlpReceiver()
    try:
        yield receiver
    finally:
        receiver.close()


@pytest.fixture(scope="session")
def mesh(tmp_path_factory, model_dir, model_path, otlp):
    # Exactly what README's `make run` does (its install step is a no-op once `make test` ran).
    with running_mesh(
        tmp_path_factory.mktemp("mesh"),
        model_dir,
        ["make", "--no-print-directory", "-C", str(ROOT), "run"],
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp.endpoint,
        # two models; the launcher starts workers for the first only, and a host agent (test_models)
        MESH_MODELS=json.dumps(CATALOGUE),
        MESH_STARTED_MODELS=EMBEDDED_MODEL,
        MESH_MODEL_WAIT_S="110",  # an engine starts within it, on this machine (within MESH_REQUEST_TIMEOUT_S)
    ) as mesh:
        yield mesh


class Reference:
    """Starts without waiting, so its engine loads while the mesh does; the first call waits."""

    def __init__(self, proc: subprocess.Popen, log_name: str):
        self.proc, self.log_name, self.ready = proc, log_name, False

    def generate(
        self,
        max_tokens: int,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        top: bool = False,
        ignore_eos: bool = False,
        reasoning_ended: bool | None = None,
        lora: dict | None = None,
        **sampling: object,
    ) -> dict:
        """Greedy; `sampling`: more of vLLM's sampling parameters; `reasoning_ended`: vLLM's (None: the engine's
        reasoning parser reads the prompt); `lora`: a LoRA adapter's {"name", "path"} (an engine started with
        LoRA on)."""
        return self._ask(
            {"max_tokens": max_tokens, "top": top, "ignore_eos": ignore_eos, "sampling": sampling}
            | ({"prompt": prompt} if prompt is not None else {"prompt_token_ids": prompt_token_ids})
            | ({} if reasoning_ended is None else {"reasoning_ended": reasoning_ended})
            | ({} if lora is None else {"lora": lora})
        )

    def greedy_gaps(
        self, prompt_token_ids: list[int], output_token_ids: list[int], lora: dict | None = None
    ) -> list[float]:
        """How far each output token's logprob falls below the likeliest token's, given the prompt
        and the outputs before it (0 where this engine's greedy decoding would have chosen it): a
        check of every token of an output, not only up to where it first parts from this engine's."""
        return self._ask(
            {
                "prompt_token_ids": [*prompt_token_ids, *output_token_ids],
                "max_tokens": 1,
                "score_from": len(prompt_token_ids),
            }
            | ({} if lora is None else {"lora": lora})
        )["gaps"]

    def _ask(self, req: dict) -> dict:
        if not self.ready:
            assert self.proc.stdout.readline().strip(), f"reference engine failed to start (see {self.log_name})"
            self.ready = True
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())


@contextmanager
def reference_engine(
    model_path: str,
    log_dir: Path,
    tensor_parallel_size: int = 1,
    reasoning_parser: str = "",
    engine_args: dict | None = None,
) -> Iterator[Reference]:
    """A monolithic engine; with several tensor-parallel ranks, a core each; with vLLM's `reasoning_parser` and
    more of its `engine_args`."""
    log = open(log_dir / "reference.log", "w")
    ranks = (
        {"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tensor_parallel_size)))}
        if tensor_parallel_size > 1
        else {}
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("reference_engine.py")),
            model_path,
            str(MAX_MODEL_LEN),
            str(BLOCK_SIZE),
            str(tensor_parallel_size),
            reasoning_parser,
            json.dumps(engine_args or {}),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        start_new_session=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"} | ranks,
    )
    try:
        yield Reference(proc, log.name)
    finally:
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        log.close()


def assert_echoed_as_vllm(choice, expected: dict, top: int) -> None:
    """A completion choice asked with `echo` and `logprobs=top` against the monolithic engine's answer for
    its prompt with `prompt_logprobs` and `logprobs` of `top`: the prompt's text before the output's, and
    every token's text, logprob and candidates as vLLM's server renders them."""
    steps = expected["prompt_steps"] + expected["steps"]
    assert choice.text == expected["prompt_text"] + expected["text"]
    got = choice.logprobs
    assert got.tokens == [step[0][2] for step in steps]
    assert got.token_logprobs == [step[0][1] for step in steps]
    assert got.top_logprobs == [None] + [{text: lp for _, lp, text in step[: top + 1]} for step in steps[1:]]
    assert got.text_offset == list(itertools.accumulate(map(len, got.tokens[:-1]), initial=0))


@pytest.fixture(scope="session")
def reference(model_path, tmp_path_factory):
    with reference_engine(model_path, tmp_path_factory.mktemp("reference")) as engine:
        yield engine
