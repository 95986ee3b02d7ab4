"""The mesh laid out as the multi-host compose files deploy it (a control plane and GPU hosts,
`python -m llmesh.deploy.compose`), run for real in network namespaces (tests/hosts.py):

    host control: nats-server accepting leaf nodes, redis-server, the router, the length predictor
    host gpu-1:   nats-server, a leaf node of control's; a kv-store shard; the prefill worker
    host gpu-2:   nats-server, a leaf node of control's; a kv-store shard; the decode worker

Every service reaches NATS on its own host. Each host's nats-server runs from the config that its
generated compose file's `secrets` service writes (the same command, on that host's copy of the
secrets, ports as in the files: each host is its own network); the leaf links carry the bus between hosts,
and KV crosses from gpu-1 to gpu-2 over TCP (each host reaches its own shard through shared
memory). Outputs equal a monolithic engine's.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from hosts import Hosts

from llmesh.deploy import compose
from llmesh.deploy.credentials import EVERYTHING, load_or_create
from llmesh.deploy.credentials import main as credentials
from llmesh.deploy.launcher import (
    Child,
    free_port,
    nats_server_binary,
    start_redis,
    start_service,
    stop_all,
    wait_for_port,
    wait_healthy,
)
from llmesh.wire.bus import Bus
from llmesh.wire.messages import KvStats, KvStatsRequest, Subjects
from llmesh.wire.secrets import without_userinfo

from .conftest import BLOCK_SIZE, MAX_MODEL_LEN
from .test_mesh import MODEL, token_prompt

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.own_engines,
    pytest.mark.timeout(900),
    pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
]
GPU_HOSTS = ("gpu-1", "gpu-2")
ROLE = {"gpu-1": "prefill", "gpu-2": "decode"}  # each GPU host's one worker


@pytest.fixture(scope="module")
def multihost(tmp_path_factory, model_dir, model_path):
    work = tmp_path_factory.mktemp("multihost")
    logs = work / "logs"
    logs.mkdir()
    children: list[Child] = []
    with Hosts(["control", *GPU_HOSTS]) as hosts:
        try:
            control, nats_port = hosts.address("control"), 4222
            secrets = load_or_create(work / "control", extra_users={"harness": EVERYTHING})
            layouts = {"control": compose.control_plane(control, "0.0.0.0")} | {
                host: compose.gpu_host(
                    control,
                    hosts.address(host),
                    {role: [["0"]] if role == ROLE[host] else [] for role in compose.ROLES},
                    None,
                    ".",
                )
                for host in GPU_HOSTS
            }

            def start_nats(host: str) -> None:
                """nats-server on `host`, from the config its compose file's `secrets` service writes."""
                made = [
                    str(work / host) if arg == "/secrets" else arg
                    for arg in layouts[host]["services"]["secrets"]["command"][1:]
                ]
                assert credentials(made) == 0
                children.append(
                    Child(
                        f"nats-{host}",
                        [nats_server_binary(), "-c", str(work / host / "nats.conf")],
                        log_path=logs / f"nats-{host}.log",
                        prefix=hosts.prefix(host),
                    )
                )
                wait_for_port(nats_port, 10, children[-1].proc, hosts.address(host))

            start_nats("control")
            redis, redis_url = start_redis(
                free_port(), logs / "redis.log", secrets.redis_password, host=control, prefix=hosts.prefix("control")
            )
            children.append(redis)
            for host in GPU_HOSTS:
                shutil.copytree(work / "control", work / host)  # the operator copies the set to each GPU host
                start_nats(host)

            def run(host: str, service: str, name: str, **own: str) -> None:
                env = {
                    "MESH_NATS_URL": f"nats://{hosts.address(host)}:{nats_port}",
                    "MESH_SECRETS_DIR": str(work / host),
                    "MESH_REDIS_URL": without_userinfo(redis_url),
                    "MESH_MODEL_DIR": str(model_dir),
                    "MESH_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
                    "MESH_BLOCK_SIZE": str(BLOCK_SIZE),
                }
                children.append(
                    start_service(service, env | own, logs / f"{name}.log", name, prefix=hosts.prefix(host))
                )

            def metrics_env(host: str, kind: str) -> dict[str, str]:
                """Where the host's compose file has a service of `kind` serve /metrics."""
                [service] = [s for name, s in layouts[host]["services"].items() if name.startswith(kind)]
                return {k: str(v) for k, v in service["environment"].items() if "_METRICS_" in k}

            for shard, host in enumerate(GPU_HOSTS, 1):
                run(
                    host,
                    "kv-store",
                    f"kv-store-{host}",
                    MESH_KV_SHARD=str(shard),
                    MESH_DATA_HOST=hosts.address(host),
                    MESH_CAPACITY_BYTES=str(256 << 20),
                    MESH_DATA_DIR=str(work / f"ssd-{host}"),
                    **metrics_env(host, "kv-store"),
                )
            run(
                "gpu-1",
                "prefill-worker",
                "prefill",
                MESH_WORKER_ID="prefill-gpu-1",
                MESH_CPU_CORES="0",
                **metrics_env("gpu-1", "prefill-worker"),
            )
            run(
                "gpu-2",
                "decode-worker",
                "decode",
                MESH_WORKER_ID="decode-gpu-2",
                MESH_CPU_CORES="1",
                **metrics_env("gpu-2", "decode-worker"),
            )
            port = free_port()
            run("control", "length-predictor", "length-predictor")
            run("control", "router", "router", MESH_HOST=control, MESH_PORT=str(port))
            url = f"http://{control}:{port}"
            wait_healthy(url, 420, children)  # the workers' heartbeats crossed the leaf links
            targets = {host: compose.prometheus_targets(hosts.address(host), layouts[host]) for host in GPU_HOSTS}
            yield (
                url,
                secrets.nats_url(f"nats://{control}:{nats_port}", "harness"),
                {"Authorization": f"Bearer {secrets.api_key}"},
                (hosts, targets),
            )
        finally:
            stop_all(children)


async def shard_stats(nats_url: str) -> dict[str, KvStats]:
    bus = await Bus.connect(nats_url, "test-multihost")
    try:
        return {
            name: (await bus.request(Subjects.kv(name, "stats"), KvStatsRequest(), KvStats, timeout=30))[0]
            for name in ("1", "2")
        }
    finally:
        await bus.close()


def test_the_bus_crosses_leaf_nodes_kv_crosses_hosts_and_outputs_are_exact(multihost, reference):
    url, nats_url, headers, _ = multihost
    before = asyncio.run(shard_stats(nats_url))
    for i, length in enumerate((127, 129, 700, 1500)):  # around a block boundary, and longer
        ids = token_prompt(length, seed=9500 + i)
        resp = httpx.post(
            f"{url}/v1/completions",
            headers=headers,
            timeout=120,
            json={"model": MODEL, "prompt": ids, "max_tokens": 16, "temperature": 0, "return_token_ids": True},
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == reference.generate(16, prompt_token_ids=ids)["token_ids"]
    after = asyncio.run(shard_stats(nats_url))
    assert all(after[name].hits > before[name].hits for name in after)  # decode loaded from both hosts' shards
    assert after["1"].bytes_got > before["1"].bytes_got  # gpu-1's shard to gpu-2's decode: over TCP


def test_the_control_planes_prometheus_reaches_every_gpu_hosts_metrics(multihost):
    """Each target that `gpu-host --prometheus-targets` lists answers /metrics from the control host,
    with the metrics of the job its control-plane Prometheus scrapes it as."""
    _, _, _, (hosts, targets) = multihost
    expected = {"kv-store": "llmesh_kv_hits", "workers": "vllm:kv_cache_usage_perc"}
    for host, groups in targets.items():
        assert sorted(g["labels"][compose.JOB_LABEL] for g in groups) == ["kv-store", "workers"], groups
        for group in groups:
            [target] = group["targets"]
            assert target.startswith(hosts.address(host) + ":")
            fetched = subprocess.run(
                [
                    *hosts.prefix("control"),
                    sys.executable,
                    "-c",
                    "import httpx, sys; print(httpx.get(sys.argv[1], timeout=10).text)",
                    f"http://{target}/metrics",
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert fetched.returncode == 0, fetched.stderr
            assert expected[group["labels"][compose.JOB_LABEL]] in fetched.stdout, (target, fetched.stdout[:500])
