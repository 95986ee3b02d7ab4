"""docker-compose.yml brought up for real, in containers, with the image docker/Dockerfile builds: the `cpu
--local-images` layout (the same services, settings and health checks; vLLM's CPU engines; nats-server and
redis-server from the llmesh image; no Jaeger, Prometheus or Grafana, whose images come only from a registry)
under rootful podman (tests/compose/podman.py). Not in `make test` (the images take minutes the first time):
`make compose-test` runs it, and every change under docker/ or to the compose files is run with it.

The model is given as a host folder of weights, mounted at /models (MESH_MODEL_DIR) and named by its folder's
name (MESH_MODEL), with a Hugging Face token as a secret file (MESH_HF_TOKEN_FILE): the same weights the
monolithic reference engine runs on this host, so greedy outputs through the containers must equal its own."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import httpx
import pytest

from llmesh.engine.models import resolve_model
from llmesh.wire.config import EMBEDDED_MODEL

from ..e2e.conftest import reference_engine
from ..e2e.test_live_migration import NEAR_TIE
from .podman import CACHE, Compose, HealthChecks, Podman, install_tools

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

PROJECT = "llmesh-compose-test"
ROUTER = "http://127.0.0.1:8000"
MODEL = "tiny-llama"  # a folder of MESH_MODEL_DIR
DECODE_WORKERS = 2  # (`--scale`): one is killed, the other takes over its requests
STARTUP_S = 900


def get(url: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status
    except Exception:  # noqa: BLE001 - not up yet
        return 0


@pytest.fixture(scope="module")
def podman() -> Podman:
    install_tools()
    podman = Podman()
    podman.cpu_base()
    return podman


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model(EMBEDDED_MODEL, CACHE / "models")  # built here: the folder the containers mount


@pytest.fixture(scope="module")
def deployment(podman, model_path, tmp_path_factory):
    from tool_envs import docker_compose

    from llmesh.deploy.compose import main as write_layout

    layout, token = CACHE / "docker-compose.cpu.yml", CACHE / "hf-token"
    assert write_layout(["cpu", "--local-images", "-o", str(layout)]) == 0
    token.write_text("hf_not_a_real_token\n")
    logs = tmp_path_factory.mktemp("compose-logs")
    with podman.api() as api:
        env = api | {"MESH_MODEL_DIR": str(CACHE / "models"), "MESH_MODEL": MODEL, "MESH_HF_TOKEN_FILE": str(token)}
        env.pop("HF_TOKEN", None)
        compose = Compose(docker_compose(), layout, PROJECT, env)
        compose("down", "-v", "--remove-orphans", check=False)  # what a run that died left
        with HealthChecks(podman):
            try:
                compose("build")
                compose("up", "-d", "--scale", f"decode-worker={DECODE_WORKERS}")
                give_up = time.monotonic() + STARTUP_S
                while get(f"{ROUTER}/health") != 200 or decode_workers() < DECODE_WORKERS or not all_healthy(podman):
                    assert time.monotonic() < give_up, (
                        "the router was not healthy in time:\n" + compose("logs").stdout[-6000:]
                    )
                    time.sleep(2)
                yield podman, compose
            finally:
                (logs / "compose.log").write_text(compose("logs", check=False).stdout)
                compose("down", "-v", "--remove-orphans", check=False)
        left = podman.containers(PROJECT)
        volumes = podman("volume", "ls", "--format", "{{.Name}}").stdout.split()
        networks = podman("network", "ls", "--format", "{{.Name}}").stdout.split()
    assert not left and not [v for v in volumes if v.startswith(PROJECT)], (left, volumes)
    assert not [n for n in networks if n.startswith(PROJECT)], networks


def all_healthy(podman: Podman) -> bool:
    """Every running container of the project healthy (as `docker compose up --wait` waits for)."""
    return all(podman.health(c["Names"][0]) == "healthy" for c in podman.containers(PROJECT) if c["State"] == "running")


def decode_workers() -> int:
    try:
        return httpx.get(f"{ROUTER}/health", timeout=5).json()["workers"].get("decode", 0)
    except Exception:  # noqa: BLE001
        return 0


@pytest.fixture(scope="module")
def api_key(deployment) -> str:
    podman, _ = deployment
    mountpoint = podman("volume", "inspect", f"{PROJECT}_mesh-secrets", "--format", "{{.Mountpoint}}").stdout.strip()
    return open(f"{mountpoint}/api-key").read().strip()


@pytest.fixture(scope="module")
def reference(model_path, tmp_path_factory):
    with reference_engine(model_path, tmp_path_factory.mktemp("reference")) as engine:
        yield engine


def containers(podman: Podman, service: str) -> list[dict]:
    return [c for c in podman.containers(PROJECT) if c["Labels"]["com.docker.compose.service"] == service]


def test_every_container_is_healthy_and_the_secrets_reach_the_workers(deployment):
    podman, compose = deployment
    running = [c for c in podman.containers(PROJECT) if c["State"] == "running"]
    services = {c["Labels"]["com.docker.compose.service"] for c in running}
    assert services == {
        "nats",
        "redis",
        "redis-responses",
        "kv-store",
        "length-predictor",
        "prefill-worker",
        "decode-worker",
        "router",
        "placement",
    }, services
    for container in running:
        assert podman.health(container["Names"][0]) == "healthy", container["Names"]
    [made] = containers(podman, "secrets")
    assert made["State"] == "exited" and made["ExitCode"] == 0
    for container in containers(podman, "prefill-worker") + containers(podman, "decode-worker"):
        log = podman("logs", container["Names"][0]).stderr + podman("logs", container["Names"][0]).stdout
        assert "Hugging Face token: the file /run/secrets/hf-token" in log, container["Names"]
        assert f"model {MODEL} ({MODEL})" in log


def completion(api_key: str, prompt: str, max_tokens: int, **extra) -> dict:
    answer = httpx.post(
        f"{ROUTER}/v1/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
        | extra,
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_request_through_the_published_port_equals_monolithic_vllm(deployment, api_key, reference):
    assert httpx.get(f"{ROUTER}/v1/models", timeout=10).status_code == 401  # the API key is needed
    models = httpx.get(f"{ROUTER}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    for prompt in ("The quick brown fox", "Containers hold the whole mesh: " * 20):
        answer = completion(api_key, prompt, 48)["choices"][0]
        expected = reference.generate(48, prompt=prompt)
        assert answer["token_ids"] == expected["token_ids"] and answer["text"] == expected["text"], prompt


def test_a_killed_decode_worker_container_loses_no_request(deployment, api_key, reference):
    """A long stream's decode worker is SIGKILLed: the stream goes on from the KV its worker stored, on the
    other decode worker, to its end (greedy under the reference but for near-ties at the cut), and the killed
    container is started again by its restart policy."""
    podman, _ = deployment
    prompt, tokens = "A long answer, cut in the middle: " * 8, []
    with httpx.stream(
        "POST",
        f"{ROUTER}/v1/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        json={
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
        timeout=300,
    ) as stream:
        killed = None
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            tokens += chunk["choices"][0].get("token_ids") or []
            if killed is None and len(tokens) >= 100:
                killed = kill_the_decode_worker_holding_a_request(podman)
    assert killed and len(tokens) == 1500
    ids = reference.generate(1, prompt=prompt)["prompt_token_ids"]
    gaps = reference.greedy_gaps(ids, tokens)
    assert max(gaps) <= NEAR_TIE, f"a token {max(gaps):.3f} nats below the likeliest"
    give_up = time.monotonic() + STARTUP_S
    while decode_workers() < DECODE_WORKERS:  # restarted (restart: on-failure), its engine loaded again
        assert time.monotonic() < give_up, "the killed decode worker did not come back"
        time.sleep(2)
    [restarted] = [c for c in containers(podman, "decode-worker") if c["Names"][0] == killed]
    assert restarted["State"] == "running"


def kill_the_decode_worker_holding_a_request(podman: Podman) -> str:
    """SIGKILL the decode worker container that placement lists as holding a request; its name."""
    [placement] = containers(podman, "placement")
    table = podman("exec", placement["Names"][0], "python3", "-m", "llmesh_placement.cli", "requests").stdout
    holders = {line.split()[1] for line in table.splitlines()[1:] if line.split()[1].startswith("decode-")}
    assert len(holders) == 1, table
    [holder] = holders
    for container in containers(podman, "decode-worker"):  # a worker's id is decode-<host name>-<pid>
        if holder.startswith(f"decode-{container['Id'][:12]}-"):
            # its process killed from here, as a crash kills it: `podman kill` is a stop asked for, which no
            # restart policy undoes (nor Docker's)
            os.kill(int(podman("inspect", container["Names"][0], "--format", "{{.State.Pid}}").stdout), signal.SIGKILL)
            return container["Names"][0]
    raise AssertionError(f"no decode worker container is {holder}")
