"""Compose files for GPU layouts beyond docker-compose.yml's one prefill and one decode worker,
written from that file (its services, settings and health checks are the one source):

    python -m llmesh.deploy.compose single --prefill 0,1 --decode 2 --decode 3 -o docker-compose.gpus.yml
    python -m llmesh.deploy.compose control-plane --address 10.0.0.1 -o docker-compose.control.yml
    python -m llmesh.deploy.compose gpu-host --control-plane 10.0.0.1 --address 10.0.0.2 --prefill 0 --decode 1 \\
        -o docker-compose.gpu-host.yml

Each `--prefill`/`--decode` is one worker and the GPUs it gets (by id: Docker pools no GPUs between
containers); a worker of several GPUs runs that many tensor-parallel ranks. Workers of different sizes need
`--kv-heads-per-chunk` (MESH_KV_HEADS_PER_CHUNK). One GPU may hold a prefill and a decode worker
(`single --prefill 0 --decode 0`: they split its memory and start one after the other); or, for a catalogue
served aggregated, decode workers alone (`single --decode 0`).

`--host-agent GPU` (repeatable; `single` and `gpu-host`) adds a host agent (llmesh_hostagent) with that
GPU: a Prism device whose `--host-memory-gib` placement splits among the models it activates there
(MESH_MODELS: the catalogue; MESH_MODEL must then be its first entry's model). Its standbys, and the
workers they become, run in its container on its GPU, each engine with the KV space placement gives it;
they serve no /metrics of their own (one port a container).

- `single`: everything on one host, as docker-compose.yml, with these workers.
- `control-plane`: NATS (accepting GPU hosts' nats-servers as leaf nodes on :7422), Redis, the router,
  placement, the length predictor, Jaeger, Prometheus and Grafana; the ports GPU hosts use (NATS leaf
  nodes, Redis, OTLP) published on `--listen` (default all interfaces).
- `gpu-host`: a nats-server that is a leaf node of the control plane's (the host's services reach NATS
  locally), a kv-store shard (workers on this host reach it through shared memory, other hosts over
  TCP on :9200, announced as `--address`) and the workers. The host needs the control plane's secrets
  (`docker compose -f docker-compose.control.yml cp secrets:/secrets ./mesh-secrets`, then copy that
  folder to the host), mounted from `--secrets` (default ./mesh-secrets). Its /metrics are published
  on the host (the shard's on :9099, the workers' on :9103, :9104, ...); with `--prometheus-targets`
  the same command writes, instead of the compose file, their list for the control plane's Prometheus:

      python -m llmesh.deploy.compose gpu-host ... --prometheus-targets -o docker/prometheus/hosts/10.0.0.2.json

  (on the control-plane host; Prometheus reads the folder's files as they come and go).
- `cpu`: everything on one host without a GPU, as docker-compose.yml, in the image built on docker/cpu-base
  (`docker build -t llmesh-cpu-base docker/cpu-base` first): vLLM's CPU engines, eager, the host's cores split
  between prefill and decode as `make run` splits them, CPU-sized defaults. With `--local-images`, nothing comes
  from a registry: nats-server and redis-server run from the llmesh image (the binaries its packages bring:
  llmesh.deploy.servers) and Jaeger, Prometheus and Grafana are left out (tests/compose runs this with podman).
- `prometheus-config`: the control plane's Prometheus configuration, written from
  docker/prometheus/prometheus.yml (the jobs of services on GPU hosts read the folder above instead of
  Docker's DNS); committed as docker/prometheus/control-plane.yml.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from llmesh.wire.kvkeys import check_sizes_can_share
from llmesh.wire.messages import ROLES

BASE = Path(__file__).resolve().parents[2] / "docker-compose.yml"
PROMETHEUS = BASE.parent / "docker" / "prometheus"
HOST_TARGETS = "/etc/prometheus/hosts/*.json"  # in the control plane's Prometheus: GPU hosts' targets
JOB_LABEL = "__llmesh_job"  # which job scrapes a target in those files (a `__` label: gone after relabelling)
CONTROL_PLANE = (
    "secrets",
    "nats",
    "redis",
    "redis-responses",
    "jaeger",
    "router",
    "placement",
    "length-predictor",
    "prometheus",
    "grafana",
)
LEAF_PORT, REDIS_PORT, OTLP_PORT, DATA_PORT = 7422, 6379, 4318, 9200
GPU_MEMORY_UTILIZATION = 0.9  # split among the workers that share a GPU
HEALTHZ = "http://127.0.0.1:8222/healthz"  # nats-server's monitoring port (llmesh.deploy.credentials --nats-monitor)


def base() -> dict[str, Any]:
    """docker-compose.yml with its anchors and `<<` merges resolved (the `x-` blocks they came from
    dropped), each service its own copy to change."""
    if not BASE.exists():
        raise SystemExit(f"{BASE} is not here: run `python -m llmesh.deploy.compose` in the repository")
    compose = yaml.safe_load(BASE.read_text())
    return {
        "services": {name: copy.deepcopy(service) for name, service in compose["services"].items()},
        "volumes": compose["volumes"],
        "secrets": compose["secrets"],
    }


def workers(
    compose: dict[str, Any], gpus: dict[str, list[list[str]]], kv_heads_per_chunk: int | None, name_prefix: str = ""
) -> dict[str, dict[str, Any]]:
    """The worker services: one a GPU list of `gpus[role]`, from the base file's `<role>-worker`. Workers that
    share a GPU (a prefill and a decode worker on one GPU) split its memory (MESH_GPU_MEMORY_UTILIZATION, of
    the base file's fraction) and start one after the other: vLLM sizes its KV from the memory free when it
    starts, so one starting while another loads would count that one's memory as its own."""
    check_sizes_can_share([len(ids) for role in ROLES for ids in gpus[role]], kv_heads_per_chunk)
    sharing = Counter(gpu for role in ROLES for ids in gpus[role] for gpu in ids)
    out: dict[str, dict[str, Any]] = {}
    last_on: dict[str, str] = {}  # GPU -> the worker started last on it
    for role in ROLES:
        template = compose["services"][f"{role}-worker"]
        for i, ids in enumerate(gpus[role]):
            name = f"{role}-worker-{name_prefix}{i}"
            service = copy.deepcopy(template)
            env = service["environment"]
            env["MESH_WORKER_ID"] = name
            env["MESH_TENSOR_PARALLEL_SIZE"] = str(len(ids))
            if (share := max(sharing[gpu] for gpu in ids)) > 1:
                env["MESH_GPU_MEMORY_UTILIZATION"] = f"{GPU_MEMORY_UTILIZATION / share:.2f}"
                for gpu in ids:
                    if gpu in last_on:
                        service["depends_on"][last_on[gpu]] = {"condition": "service_healthy"}
                    last_on[gpu] = name
            if kv_heads_per_chunk:
                env["MESH_KV_HEADS_PER_CHUNK"] = str(kv_heads_per_chunk)
            service["deploy"]["resources"]["reservations"]["devices"] = [
                {"driver": "nvidia", "device_ids": list(ids), "capabilities": ["gpu"]}
            ]
            service["networks"] = {"default": {"aliases": [f"{role}-worker"]}}  # Prometheus finds it by role
            out[name] = service
    return out


def host_agents(
    compose: dict[str, Any], agent_gpus: Sequence[str], memory_gib: float, name_prefix: str = ""
) -> dict[str, dict[str, Any]]:
    """A host agent a GPU of `agent_gpus`, from the base file's decode worker (its image, volumes and the
    engine settings its workers inherit), with `memory_gib` for the models placed on it."""
    template = compose["services"]["decode-worker"]
    out = {}
    for i, gpu in enumerate(agent_gpus):
        name = f"host-agent-{name_prefix}{i}"
        service = copy.deepcopy(template)
        service["command"] = ["llmesh_hostagent"]
        env = service["environment"]
        for key in ("MESH_WORKER_METRICS_HOST", "MESH_WORKER_METRICS_PORT"):  # several engines, one container
            env.pop(key, None)
        env["MESH_HOST_ID"] = name
        env["MESH_HOST_MEMORY_GIB"] = str(memory_gib)
        service["deploy"]["resources"]["reservations"]["devices"] = [
            {"driver": "nvidia", "device_ids": [gpu], "capabilities": ["gpu"]}
        ]
        service.pop("healthcheck", None)  # it serves no HTTP; placement sees its heartbeats
        out[name] = service
    return out


def single(
    gpus: dict[str, list[list[str]]],
    kv_heads_per_chunk: int | None,
    agent_gpus: Sequence[str] = (),
    memory_gib: float = 0.0,
) -> dict[str, Any]:
    compose = base()
    new = workers(compose, gpus, kv_heads_per_chunk) | host_agents(compose, agent_gpus, memory_gib)
    for role in ROLES:
        del compose["services"][f"{role}-worker"]
    compose["services"].update(new)
    return compose


CPU_IMAGE, CPU_BASE = "llmesh:cpu", "llmesh-cpu-base"
REGISTRY_ONLY = ("jaeger", "prometheus", "grafana")  # left out by `--local-images`
CPU_SIZES = {  # compose variable: its CPU default (GPU-sized in docker-compose.yml)
    "MESH_MAX_MODEL_LEN": "2048",
    "MESH_CAPACITY_BYTES": str(2 * 2**30),
    "MESH_SSD_CAPACITY_BYTES": str(8 * 2**30),
}


def cpu(local_images: bool, cores: dict[str, dict[str, str]]) -> dict[str, Any]:
    """docker-compose.yml's services on CPU engines (`cores`: each worker's environment for its share of the
    host's cores, llmesh.deploy.launcher.engine_cores); with `local_images`, no image from a registry."""
    compose = base()
    services = compose["services"]
    for service in services.values():
        if "build" in service:
            service["build"]["args"] = {"BASE": CPU_BASE, "ENGINE": "cpu"}
        if service.get("image", "").startswith("llmesh:"):
            service["image"] = CPU_IMAGE
        env = service.get("environment")
        if isinstance(env, dict):
            for key in env.keys() & CPU_SIZES.keys():
                env[key] = f"${{{key}:-{CPU_SIZES[key]}}}"
    for role in ROLES:
        worker = services[f"{role}-worker"]
        del worker["deploy"]
        worker["environment"] |= {"MESH_ENFORCE_EAGER": "true"} | cores.get(f"{role}-worker", {})
    if local_images:
        for name in REGISTRY_ONLY:
            del services[name]
        for service in services.values():
            if isinstance(service.get("environment"), dict):
                service["environment"].pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
        servers = ["python3", "-m", "llmesh.deploy.servers"]
        nats = services["nats"]
        nats |= {"image": CPU_IMAGE, "entrypoint": [*servers, "nats"]}
        nats["healthcheck"]["test"] = ["CMD", "python3", "-m", "llmesh.deploy.healthcheck", HEALTHZ]
        password = ["--password-file", "/secrets/redis-password"]
        kept = ["--dir", "/data", "--appendonly", "yes", "--appendfsync", "everysec"]  # (as the base file's)
        for name, persistence in (("redis", ["--appendonly", "no"]), ("redis-responses", kept)):
            redis = services[name]
            redis |= {
                "image": CPU_IMAGE,
                "entrypoint": [*servers, "redis"],
                "command": [*password, "--save", '""', *persistence],
                "healthcheck": redis["healthcheck"] | {"test": ["CMD", *servers, "redis-ping", *password]},
            }
    return compose


def _published(port: int, listen: str) -> str:
    return f"{listen}:{port}:{port}"


def control_plane(address: str, listen: str) -> dict[str, Any]:
    compose = base()
    services = compose["services"]
    compose["services"] = {name: services[name] for name in CONTROL_PLANE}
    secrets = compose["services"]["secrets"]
    secrets["command"] += ["--nats-leafnodes", f"0.0.0.0:{LEAF_PORT}", "--tls-host", address]
    compose["services"]["nats"]["ports"] = [_published(LEAF_PORT, listen)]
    compose["services"]["redis"]["ports"] = [_published(REDIS_PORT, listen)]
    jaeger = compose["services"]["jaeger"]
    jaeger["ports"] = [p for p in jaeger["ports"] if not str(p).endswith(f":{OTLP_PORT}")] + [
        _published(OTLP_PORT, listen)
    ]
    compose["services"]["prometheus"]["volumes"] = [
        "./docker/prometheus/control-plane.yml:/etc/prometheus/prometheus.yml:ro",
        f"./docker/prometheus/hosts:{HOST_TARGETS.rsplit('/', 1)[0]}:ro",
    ]
    del compose["volumes"]["kv-data"]  # (models: the router's tokenizers, for tool-call parsers)
    return compose


def control_plane_prometheus() -> str:
    """docker/prometheus/prometheus.yml for the control plane: a job whose DNS names are services of GPU
    hosts scrapes instead the targets of that job in the GPU hosts' files (`prometheus_targets`)."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        names = {name for dns in job.get("dns_sd_configs", []) for name in dns["names"]}
        if names and not names & set(CONTROL_PLANE):
            del job["dns_sd_configs"]
            job["file_sd_configs"] = [{"files": [HOST_TARGETS]}]
            job["relabel_configs"] = [{"source_labels": [JOB_LABEL], "regex": job["job_name"], "action": "keep"}]
    return (
        "# The control plane's Prometheus (`python -m llmesh.deploy.compose control-plane`), written by\n"
        "# `python -m llmesh.deploy.compose prometheus-config` from prometheus.yml: write it again rather than\n"
        "# editing it. GPU hosts' targets: docker/prometheus/hosts/*.json (`gpu-host --prometheus-targets`).\n"
        + yaml.dump(config, Dumper=_NoAliases, sort_keys=False, width=120)
    )


class _NoAliases(yaml.SafeDumper):
    """Writes a block used twice twice, as a reader expects, not as an anchor and `*id001`."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def prometheus_targets(address: str, compose: dict[str, Any]) -> list[dict[str, Any]]:
    """Prometheus's file_sd target groups for a `gpu_host` layout: its services' /metrics, each group
    labelled with the job that scrapes it and the compose service it came from."""
    jobs = {
        dns_name: job["job_name"]
        for job in yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())["scrape_configs"]
        for dns in job.get("dns_sd_configs", [])
        for dns_name in dns["names"]
    }
    groups = []
    for name, service in compose["services"].items():
        kind = (service.get("networks", {}).get("default", {}).get("aliases") or [name])[0]  # its name on one host
        for published in service.get("ports", []) if kind in jobs else []:
            host_port, inside = published.split(":")[-2:]
            if int(inside) == _metrics_port(service):
                groups.append(
                    {
                        "targets": [f"{address}:{host_port}"],
                        "labels": {JOB_LABEL: jobs[kind], "service": kind, "compose_service": name},
                    }
                )
    return groups


def _metrics_port(service: dict[str, Any]) -> int:
    """Where a llmesh service of docker-compose.yml serves /metrics (its `MESH_*METRICS_PORT`)."""
    [port] = [int(v) for k, v in service["environment"].items() if k.endswith("METRICS_PORT")]
    return port


def gpu_host(
    control: str,
    address: str,
    gpus: dict[str, list[list[str]]],
    kv_heads_per_chunk: int | None,
    secrets_path: str,
    agent_gpus: Sequence[str] = (),
    memory_gib: float = 0.0,
) -> dict[str, Any]:
    compose = base()
    services = compose["services"]
    shard = address.replace(".", "-").replace(":", "-")
    mount = f"{secrets_path}:/secrets"
    remote = {
        "MESH_NATS_URL": "nats://nats:4222",
        "MESH_REDIS_URL": f"redis://{control}:{REDIS_PORT}/0",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{control}:{OTLP_PORT}",
    }

    def on_this_host(service: dict[str, Any]) -> dict[str, Any]:
        service["environment"].update(remote)
        service["volumes"] = [mount + ":ro" if v.startswith("mesh-secrets:") else v for v in service["volumes"]]
        service["depends_on"].pop("redis", None)  # the control plane's
        service["depends_on"]["secrets"] = {"condition": "service_completed_successfully"}
        return service

    nats_config = services["secrets"]  # writes this host's nats.conf (a leaf node) into its copy of the set
    nats_config["command"] = [
        "llmesh.deploy.credentials",
        "/secrets",
        "--nats-listen",
        "0.0.0.0:4222",
        "--nats-leaf-of",
        f"{control}:{LEAF_PORT}",
        "--nats-monitor",
        "127.0.0.1:8222",
    ]
    nats_config["volumes"] = [mount]
    nats = services["nats"]
    nats["volumes"] = [mount + ":ro"]
    kv_store = on_this_host(services["kv-store"])
    kv_store["environment"] |= {"MESH_KV_SHARD": shard, "MESH_DATA_ADVERTISE_HOST": address}
    kv_store["ports"] = [
        f"0.0.0.0:{DATA_PORT}:{DATA_PORT}",  # other hosts' workers load over TCP
        f"0.0.0.0:{_metrics_port(kv_store)}:{_metrics_port(kv_store)}",
    ]  # the control plane scrapes
    kept = {"secrets": nats_config, "nats": nats, "kv-store": kv_store}
    for i, (name, service) in enumerate(workers(compose, gpus, kv_heads_per_chunk, f"{shard}-").items()):
        kept[name] = on_this_host(service)
        kept[name]["ports"] = [f"0.0.0.0:{_metrics_port(service) + i}:{_metrics_port(service)}"]  # one port a worker
    for name, service in host_agents(compose, agent_gpus, memory_gib, f"{shard}-").items():
        kept[name] = on_this_host(service)
    compose["services"] = kept
    compose["volumes"] = {"models": compose["volumes"]["models"], "kv-data": compose["volumes"]["kv-data"]}
    return compose


def scale_plan(advice: int, running: int, prefill: str, decode_gpus: Sequence[str], out: str) -> list[str]:
    """The commands that carry out placement's scaling advice (+1, -1, 0) on a one-host compose deployment
    (the `single` layout) running `running` decode workers, one GPU of `decode_gpus` each in order, and a
    prefill worker on `prefill`: none when the advice is to hold or a bound (1, len(decode_gpus)) is reached.
    Up: the layout with one more worker, brought up beside the running ones. Down: the last worker drained
    first (its requests migrate away; it exits with status 0, which `restart: on-failure` leaves down), then
    the layout without it, which removes its container."""
    target = min(max(running + advice, 1), len(decode_gpus))
    if target == running:
        return []
    layout = (
        f"python -m llmesh.deploy.compose single --prefill {prefill} "
        + " ".join(f"--decode {g}" for g in decode_gpus[:target])
        + f" -o {out}"
    )
    up = f"docker compose -f {out} up -d --no-recreate --remove-orphans"
    if target > running:
        return [layout, up]
    last = f"decode-worker-{running - 1}"
    return [
        f"python -m llmesh_placement.cli drain {last}",
        f"until ! python -m llmesh_placement.cli workers | grep -q '^{last} '; do sleep 2; done",
        layout,
        up,
    ]


def _gpu_lists(values: list[str] | None) -> list[list[str]]:
    return [[g.strip() for g in value.split(",") if g.strip()] for value in values or []]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmesh.deploy.compose", description=__doc__.split("\n\n")[0])
    parser.add_argument("layout", choices=["single", "control-plane", "gpu-host", "cpu", "prometheus-config"])
    parser.add_argument(
        "--prefill",
        action="append",
        metavar="GPUS",
        help="a prefill worker and its GPU ids, e.g. 0 or 0,1 (two tensor-parallel ranks); repeatable",
    )
    parser.add_argument("--decode", action="append", metavar="GPUS", help="a decode worker and its GPU ids; repeatable")
    parser.add_argument(
        "--kv-heads-per-chunk",
        type=int,
        default=None,
        help="MESH_KV_HEADS_PER_CHUNK for every worker (needed when their sizes differ)",
    )
    parser.add_argument(
        "--address",
        help="this host's address as other hosts reach it (control-plane: for "
        "NATS's TLS certificate; gpu-host: its kv-store's data plane)",
    )
    parser.add_argument("--control-plane", help="gpu-host: the control plane's address")
    parser.add_argument("--listen", default="0.0.0.0", help="control-plane: where the ports GPU hosts use listen")
    parser.add_argument(
        "--secrets", default="./mesh-secrets", help="gpu-host: the copy of the control plane's secrets on this host"
    )
    parser.add_argument(
        "--prometheus-targets",
        action="store_true",
        help="gpu-host: write the host's /metrics "
        "for the control plane's Prometheus (docker/prometheus/hosts/ADDRESS.json), not its compose",
    )
    parser.add_argument(
        "--host-agent",
        action="append",
        default=[],
        metavar="GPU",
        help="single, gpu-host: a host agent with this GPU, which placement activates models on; repeatable",
    )
    parser.add_argument(
        "--host-memory-gib",
        type=float,
        default=0.0,
        help="with --host-agent: the GPU memory the models placed on each agent's GPU may hold",
    )
    parser.add_argument(
        "--local-images",
        action="store_true",
        help="cpu: no image from a registry (nats-server and redis-server from the llmesh image; no Jaeger, "
        "Prometheus or Grafana)",
    )
    parser.add_argument("-o", "--out", type=Path, help="write here (default: standard output)")
    args = parser.parse_args(argv)
    gpus = {"prefill": _gpu_lists(args.prefill), "decode": _gpu_lists(args.decode)}
    agents = [g.strip() for g in args.host_agent]
    if agents and (args.layout not in ("single", "gpu-host") or args.host_memory_gib <= 0):
        parser.error("--host-agent is for single and gpu-host, with --host-memory-gib")
    if any(not g or "," in g for g in agents):
        parser.error("a host agent takes one GPU (its standbys have one rank)")
    if args.prometheus_targets and args.layout != "gpu-host":
        parser.error("--prometheus-targets is for gpu-host")
    if args.local_images and args.layout != "cpu":
        parser.error("--local-images is for cpu")
    try:
        if args.layout == "prometheus-config":
            return _write(control_plane_prometheus(), args.out)
        if args.layout == "cpu":
            from llmesh.deploy.launcher import engine_cores

            compose = cpu(args.local_images, engine_cores())
        elif args.layout == "control-plane":
            if not args.address:
                parser.error("control-plane needs --address")
            compose = control_plane(args.address, args.listen)
        else:
            if not (gpus["prefill"] or gpus["decode"]) or any(not ids for ids in [*gpus["prefill"], *gpus["decode"]]):
                parser.error("give each worker's GPUs: --prefill 0 --decode 1 ...")
            if args.layout == "single":
                if not gpus["decode"]:
                    parser.error(
                        "single needs a decode worker at least (and a prefill worker unless every model in "
                        "MESH_MODELS is served aggregated)"
                    )
                compose = single(gpus, args.kv_heads_per_chunk, agents, args.host_memory_gib)
            else:
                if not (args.control_plane and args.address):
                    parser.error("gpu-host needs --control-plane and --address")
                compose = gpu_host(
                    args.control_plane,
                    args.address,
                    gpus,
                    args.kv_heads_per_chunk,
                    args.secrets,
                    agents,
                    args.host_memory_gib,
                )
    except ValueError as exc:
        parser.error(str(exc))
    for role in ROLES:
        if any(len(set(ids)) != len(ids) for ids in gpus[role]):
            parser.error(f"a {role} worker is given a GPU twice: {gpus[role]}")
        flat = [g for ids in gpus[role] for g in ids]
        if len(flat) != len(set(flat)):
            parser.error(f"a GPU is given to two {role} workers: {gpus[role]} (workers of one role share none)")
    if set(agents) & {g for ids in [*gpus["prefill"], *gpus["decode"]] for g in ids} or len(agents) != len(set(agents)):
        parser.error(f"a host agent's GPU is given to a worker or another agent: {agents}")
    if args.prometheus_targets:
        return _write(json.dumps(prometheus_targets(args.address, compose), indent=1) + "\n", args.out)
    return _write(
        f"# Written by `python -m llmesh.deploy.compose {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"from docker-compose.yml; write it again rather than editing it.\n"
        + yaml.safe_dump(compose, sort_keys=False, width=120),
        args.out,
    )


def _write(text: str, out: Path | None) -> int:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
