"""docker-compose.yml agrees with the code: modules, environment variables, GPUs, NATS config, secrets.

No Docker engine is needed: the file is parsed (YAML anchors and `<<` merges resolved by PyYAML)
and compared with `llmesh.deploy.launcher.SERVICES` and the services' pydantic settings classes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

from llmesh.deploy.compose import scale_plan
from llmesh.deploy.credentials import load_or_create
from llmesh.deploy.launcher import SERVICES
from llmesh.wire.config import WorkerSettings
from llmesh_hostagent.settings import HostAgentSettings
from llmesh_kvstore.settings import KvStoreSettings
from llmesh_lengthpred.settings import LengthPredictorSettings
from llmesh_placement.settings import PlacementSettings
from llmesh_router.settings import RouterSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PROMETHEUS_CONFIG = ROOT / "docker" / "prometheus" / "prometheus.yml"

SETTINGS: dict[str, type[BaseSettings]] = {
    "kv-store": KvStoreSettings,
    "length-predictor": LengthPredictorSettings,
    "prefill-worker": WorkerSettings,
    "decode-worker": WorkerSettings,
    "router": RouterSettings,
    "placement": PlacementSettings,
}
# launcher services not in docker-compose.yml, and where they are
NOT_IN_COMPOSE = {
    "host-agent": "one a GPU, in the layouts `python -m llmesh.deploy.compose ... --host-agent GPU` writes: "
    "its standbys and workers run in its container, so it needs a GPU of its own (LAYOUTS below)"
}
# what a layout-only service's environment may set: its own settings' and those of the workers it starts
LAYOUT_SETTINGS: dict[str, tuple[type[BaseSettings], ...]] = {"host-agent": (HostAgentSettings, WorkerSettings)}
LLMESH_SERVICES = sorted(SETTINGS)
EXPECTED_SERVICES = {"secrets", "nats", "redis", "jaeger", "prometheus", "grafana", *LLMESH_SERVICES}
# where each service serves Prometheus's /metrics: its settings' (port, bind address) fields
METRICS_FIELDS = {
    "kv-store": ("metrics_port", "metrics_host"),
    "length-predictor": ("length_metrics_port", "length_metrics_host"),
    "prefill-worker": ("worker_metrics_port", "worker_metrics_host"),
    "decode-worker": ("worker_metrics_port", "worker_metrics_host"),
    "router": ("port", "host"),
    "placement": ("placement_metrics_port", "placement_metrics_host"),
}


@pytest.fixture(scope="module")
def services() -> dict[str, dict]:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(compose, dict) and isinstance(compose.get("services"), dict), (
        f"{COMPOSE_FILE.name} has no `services` mapping"
    )
    return compose["services"]


def environment(service: dict) -> dict[str, str | None]:
    """A service's environment, given as a mapping or a list of "K=V" (or bare "K") strings."""
    env = service.get("environment") or {}
    if isinstance(env, dict):
        return {str(k): None if v is None else str(v) for k, v in env.items()}
    out: dict[str, str | None] = {}
    for item in env:
        key, sep, value = str(item).partition("=")
        out[key] = value if sep else None
    return out


def command(service: dict) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def env_names(settings: type[BaseSettings]) -> set[str]:
    """Every environment variable the settings class reads."""
    prefix = settings.model_config.get("env_prefix", "")
    names = set()
    for field_name, field in settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(c for c in alias.choices if isinstance(c, str))
        elif isinstance(alias, str):
            names.add(alias)
        else:  # without an alias pydantic-settings reads prefix + field name
            names.add(f"{prefix}{field_name}")
    if not settings.model_config.get("case_sensitive", False):
        names = {n.upper() for n in names}
    return names


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` / `${VAR-default}` / `${VAR}` with the host variable unset."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}", lambda m: m.group(1) or "", value)


def port_numbers(service: dict) -> set[int]:
    """Container ports a service publishes or exposes (short "host:container" or long syntax)."""
    ports = set()
    for entry in [*(service.get("ports") or []), *(service.get("expose") or [])]:
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            container = str(entry).split("/")[0].rsplit(":", 1)[-1]
            ports.add(int(container))
    return ports


def test_services_exist(services):
    missing = EXPECTED_SERVICES - set(services)
    assert not missing, f"{COMPOSE_FILE.name} lacks services {sorted(missing)}"


def test_launcher_and_settings_map_agree():
    assert set(SETTINGS) | set(NOT_IN_COMPOSE) == set(SERVICES), (
        "update SETTINGS in this test when llmesh.deploy.launcher.SERVICES changes"
    )


@pytest.mark.parametrize("name", LLMESH_SERVICES)
def test_command_is_the_services_module(services, name):
    cmd = command(services[name])
    assert len(cmd) == 1, f"service {name!r}: command must be just the module name (ENTRYPOINT is python -m), got {cmd}"
    module = cmd[0]
    by_module = {m: s for s, m in SERVICES.items()}
    assert module in by_module, (
        f"service {name!r}: command module {module!r} is not in llmesh.deploy.launcher.SERVICES {sorted(by_module)}"
    )
    assert by_module[module] == name, (
        f"service {name!r} runs {module!r}, which the launcher names {by_module[module]!r}"
    )
    assert importlib.util.find_spec(module) is not None, f"service {name!r}: module {module!r} is not importable"
    assert importlib.util.find_spec(f"{module}.__main__") is not None, (
        f"service {name!r}: module {module!r} has no __main__, so `python -m {module}` cannot run it"
    )
    assert "entrypoint" not in services[name], f"service {name!r} must keep the image's `python -m` entrypoint"


def test_image_entrypoint_is_python_m():
    entrypoints = [
        line.split(None, 1)[1]
        for line in DOCKERFILE.read_text().splitlines()
        if line.strip().upper().startswith("ENTRYPOINT")
    ]
    assert entrypoints, f"{DOCKERFILE} has no ENTRYPOINT"
    entry = json.loads(entrypoints[-1])
    assert re.fullmatch(r"python(3(\.\d+)?)?", entry[0]) and entry[1:] == ["-m"], (
        f"{DOCKERFILE}: ENTRYPOINT must be python -m, got {entry}"
    )


@pytest.mark.parametrize("name", LLMESH_SERVICES)
def test_environment_is_read_by_the_settings_class(services, name):
    settings = SETTINGS[name]
    accepted = env_names(settings)
    env = environment(services[name])
    assert env, f"service {name!r} sets no environment (MESH_NATS_URL at least is needed)"
    unknown = sorted(k for k in env if k.upper() not in accepted)
    assert not unknown, (
        f"service {name!r} sets {', '.join(unknown)}, which {settings.__module__}.{settings.__name__} "
        f"does not read (it reads: {', '.join(sorted(accepted))})"
    )


def compose_settings(services: dict[str, dict], name: str, monkeypatch, tmp_path: Path) -> BaseSettings:
    """The service's settings as its compose environment makes them, the host's variables unset."""
    settings = SETTINGS[name]
    for key in env_names(settings):
        monkeypatch.delenv(key, raising=False)
    for key, value in environment(services[name]).items():
        if value is not None:
            monkeypatch.setenv(key, interpolate(value))
    if "MESH_SECRETS_DIR" in environment(services[name]):  # what the `secrets` service makes there
        load_or_create(tmp_path / "secrets")
        monkeypatch.setenv("MESH_SECRETS_DIR", str(tmp_path / "secrets"))
    return settings(_env_file=None)


@pytest.mark.parametrize("name", LLMESH_SERVICES)
def test_environment_values_parse(services, name, monkeypatch, tmp_path):
    """With the host's variables unset, the settings class accepts the compose defaults."""
    try:
        compose_settings(services, name, monkeypatch, tmp_path)
    except Exception as exc:  # noqa: BLE001 - report which service
        pytest.fail(f"service {name!r}: {SETTINGS[name].__name__} rejects its compose environment: {exc}")


def scrape_targets() -> dict[str, set[tuple[str, int]]]:
    """{job: {(host, port)}} of docker/prometheus/prometheus.yml (static targets and DNS names)."""
    jobs: dict[str, set[tuple[str, int]]] = {}
    for job in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]:
        targets = jobs.setdefault(job["job_name"], set())
        for static in job.get("static_configs", []):
            targets.update((host, int(port)) for host, port in (t.rsplit(":", 1) for t in static["targets"]))
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type") == "A" and "port" in dns, f"job {job['job_name']!r}: DNS lookups need A and a port"
            targets.update((host, int(dns["port"])) for host in dns["names"])
    return jobs


def test_prometheus_scrapes_every_service_where_it_serves_metrics(services, monkeypatch, tmp_path):
    jobs = scrape_targets()
    scraped = {host: port for targets in jobs.values() for host, port in targets}
    assert len(scraped) == sum(map(len, jobs.values())), f"a service is scraped twice: {jobs}"
    assert set(scraped) == set(METRICS_FIELDS), (
        f"Prometheus scrapes {sorted(scraped)}, the services with /metrics are {sorted(METRICS_FIELDS)}"
    )
    for name, (port_field, host_field) in METRICS_FIELDS.items():
        settings = compose_settings(services, name, monkeypatch, tmp_path)
        port, host = getattr(settings, port_field), getattr(settings, host_field)
        assert port and scraped[name] == port, f"Prometheus scrapes {name}:{scraped[name]}, its /metrics is on {port}"
        assert host == "0.0.0.0", f"service {name!r} serves /metrics on {host}, out of Prometheus's reach"


def test_prometheus_and_grafana_get_their_committed_configuration(services):
    mounts = {
        name: {src: dst.removesuffix(":ro") for src, dst in (v.split(":", 1) for v in services[name]["volumes"])}
        for name in ("prometheus", "grafana")
    }
    assert mounts["prometheus"].get("./docker/prometheus/prometheus.yml") == "/etc/prometheus/prometheus.yml"
    grafana = mounts["grafana"]
    assert grafana.get("./docker/grafana/provisioning") == "/etc/grafana/provisioning"
    providers = yaml.safe_load((ROOT / "docker/grafana/provisioning/dashboards/llmesh.yml").read_text())["providers"]
    assert [p["options"]["path"] for p in providers] == [grafana.get("./docker/grafana/dashboards")]
    for source in grafana:
        assert (ROOT / source).exists(), f"grafana mounts {source}, which is not in the repository"
    assert 9090 in port_numbers(services["prometheus"]) and 3000 in port_numbers(services["grafana"])
    env = environment(services["grafana"])
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def gpu_ids(service: dict) -> list[str]:
    """The NVIDIA GPUs a service reserves by id; fails on a reservation by count (Docker would give
    every such container the first GPU: it pools none between containers)."""
    devices = (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []
    ids = []
    for device in devices:
        assert device.get("driver") == "nvidia" and "gpu" in (device.get("capabilities") or []), device
        assert "count" not in device and device.get("device_ids"), f"a GPU reserved by count, not by id: {device}"
        ids += [interpolate(str(i)) for i in device["device_ids"]]
    return ids


def test_each_worker_names_its_own_gpu(services):
    prefill, decode = gpu_ids(services["prefill-worker"]), gpu_ids(services["decode-worker"])
    assert prefill == ["0"] and decode == ["1"], (prefill, decode)


@pytest.mark.parametrize("name", [*LLMESH_SERVICES, "nats", "redis"])
def test_every_service_reports_its_health(services, name, monkeypatch, tmp_path):
    test = services[name]["healthcheck"]["test"]
    if name in ("nats", "redis"):
        return  # their own tools (checked against the generated config below, and in compose's validation)
    assert test[:4] == ["CMD", "python", "-m", "llmesh.deploy.healthcheck"], test
    port_field, host_field = METRICS_FIELDS[name]
    port = getattr(compose_settings(services, name, monkeypatch, tmp_path), port_field)
    path = "/health" if name == "router" else "/metrics"
    assert test[4:] == [f"http://127.0.0.1:{port}{path}"], f"service {name!r} checks {test[4:]}, serves on {port}"


@pytest.mark.parametrize("name", LLMESH_SERVICES)
def test_services_start_once_what_they_need_is_healthy(services, name):
    needs = {k: v["condition"] for k, v in services[name]["depends_on"].items()}
    assert needs["nats"] == needs["redis"] == "service_healthy", needs
    if name.endswith("-worker"):
        assert needs["kv-store"] == "service_healthy", needs


def test_docker_compose_renders_and_validates_the_file(tmp_path):
    """docker-compose 1.29.2 (no engine needed; its own venv, tests/tool_envs.py) accepts the file, and
    its rendering keeps each worker's GPU."""
    from tool_envs import docker_compose

    done = subprocess.run(
        [*docker_compose(), "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
    )
    assert done.returncode == 0, done.stderr
    rendered = yaml.safe_load(done.stdout)["services"]
    assert gpu_ids(rendered["prefill-worker"]) == ["0"] and gpu_ids(rendered["decode-worker"]) == ["1"]


def test_workers_share_the_engine_configuration(services):
    prefill, decode = environment(services["prefill-worker"]), environment(services["decode-worker"])
    assert prefill == decode, f"prefill-worker and decode-worker environments differ: {prefill} != {decode}"


def test_router_binds_all_interfaces_and_is_published(services):
    env = {k: interpolate(v) for k, v in environment(services["router"]).items() if v is not None}
    assert env.get("MESH_HOST") == "0.0.0.0", "service 'router': MESH_HOST must be 0.0.0.0 in a container"
    port = int(env.get("MESH_PORT", RouterSettings.model_fields["port"].default))
    assert port in port_numbers(services["router"]), f"service 'router' does not publish its port {port}"


def test_traces_go_to_jaeger(services):
    assert 16686 in port_numbers(services["jaeger"]), "service 'jaeger' does not expose its UI port 16686"
    choices = RouterSettings.model_fields["otlp_endpoint"].validation_alias.choices
    env = environment(services["router"])
    endpoints = [interpolate(env[k]) for k in choices if env.get(k)]
    assert endpoints, f"service 'router' sets none of {list(choices)}"
    url = urlparse(endpoints[0])
    assert url.hostname == "jaeger", f"service 'router': OTLP endpoint {endpoints[0]!r} is not the jaeger service"
    assert url.port in port_numbers(services["jaeger"]) | {4318}, (
        f"service 'router': OTLP endpoint {endpoints[0]!r} is not a port of the jaeger service"
    )


def test_nats_takes_its_users_and_max_payload_from_the_generated_config(services, tmp_path):
    """nats-server reads the config `secrets` writes (llmesh.deploy.credentials --nats-listen) from the shared
    volume, after it has run; that config has the users and a max_payload."""
    nats, made = services["nats"], services["secrets"]
    cmd = command(nats)
    assert cmd[:1] == ["-c"], f"service 'nats': command {cmd} passes no -c config file"
    volume = "mesh-secrets:/secrets"
    assert f"{volume}:ro" in nats["volumes"] and volume in made["volumes"], "nats does not share the secrets volume"
    assert nats["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    made_cmd = command(made)
    assert made_cmd[0] == "llmesh.deploy.credentials" and cmd[1] == f"{made_cmd[1]}/nats.conf", (cmd, made_cmd)
    from llmesh.deploy.credentials import main

    assert main([str(tmp_path / "s"), *made_cmd[2:]]) == 0
    conf = (tmp_path / "s" / "nats.conf").read_text()
    assert re.search(r"^max_payload: \d+MB$", conf, re.MULTILINE) and "listen: 0.0.0.0:4222" in conf
    monitor = re.search(r"^http: (\S+)$", conf, re.MULTILINE)
    assert monitor and f"http://{monitor.group(1)}/healthz" in nats["healthcheck"]["test"], "nats's health check"
    assert 'user: "router"' in conf and "$2a$" in conf


@pytest.mark.parametrize("name", [*LLMESH_SERVICES, "redis"])
def test_every_service_gets_the_secrets_and_starts_after_they_are_made(services, name):
    service = services[name]
    assert "mesh-secrets:/secrets:ro" in service["volumes"], f"service {name!r} does not mount the secrets"
    assert service["depends_on"]["secrets"]["condition"] == "service_completed_successfully", name
    if name != "redis":
        assert environment(service)["MESH_SECRETS_DIR"] == "/secrets", name


def test_published_ports_listen_on_the_hosts_loopback_unless_configured(services):
    for name, service in services.items():
        for entry in service.get("ports") or []:
            assert interpolate(str(entry)).startswith("127.0.0.1:"), f"service {name!r} publishes {entry} to all"


# ---- the layouts `python -m llmesh.deploy.compose` writes from docker-compose.yml ----------------------------

LAYOUTS = {
    "single": [
        *("single", "--prefill", "0,1", "--decode", "2", "--decode", "3", "--kv-heads-per-chunk", "4"),
        *("--host-agent", "4", "--host-agent", "5", "--host-memory-gib", "70"),
    ],
    "single-aggregated": ["single", "--decode", "0", "--decode", "1"],  # for a catalogue served aggregated
    "one-gpu": ["single", "--prefill", "0", "--decode", "0"],
    "cpu": ["cpu"],
    "control-plane": ["control-plane", "--address", "10.0.0.1"],
    "gpu-host": [
        "gpu-host",
        "--control-plane",
        "10.0.0.1",
        "--address",
        "10.0.0.2",
        "--prefill",
        "0",
        "--decode",
        "1,2",
        "--kv-heads-per-chunk",
        "2",
        "--host-agent",
        "3",
        "--host-memory-gib",
        "40",
    ],
}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, dict]:
    """Each layout as docker-compose 1.29.2 renders it (so it validates, or this fails)."""
    from tool_envs import docker_compose

    from llmesh.deploy.compose import main

    out = {}
    for name, argv in LAYOUTS.items():
        path = tmp_path_factory.mktemp("layouts") / f"{name}.yml"
        assert main([*argv, "-o", str(path)]) == 0
        done = subprocess.run(
            [*docker_compose(), "-f", str(path), "config"],
            capture_output=True,
            text=True,
            env={"PATH": os.environ["PATH"]},
        )
        assert done.returncode == 0, f"{name}: {done.stderr}"
        out[name] = yaml.safe_load(done.stdout)["services"]
    return out


OPERATOR_ENV = {  # a gated model given only in MESH_MODELS, its weights in a host folder, its token in a file
    "MESH_MODELS": json.dumps(
        [
            {"name": "llama", "model": "Llama-3.1-8B-Instruct", "engine_args": {"max_num_seqs": 64}},
            {"name": "qwen", "model": "Qwen/Qwen3-8B", "lora_modules": [{"name": "sql", "path": "/models/sql"}]},
        ]
    ),
    "MESH_MODEL_DIR": "/srv/models",
    "HF_TOKEN": "hf_not_a_token",
    "MESH_HF_TOKEN_FILE": "/etc/hf-token",
}


@pytest.mark.parametrize("layout", ["docker-compose.yml", *LAYOUTS])
def test_an_operators_models_token_and_weights_reach_every_service_that_loads_them(layout, tmp_path, monkeypatch):
    """Rendered by docker-compose with the operator's variables set: the catalogue alone (MESH_MODEL unset)
    parses in every service that reads it, with the host's folder of weights mounted at /models and the token
    reaching them as a variable and as a secret file."""
    from tool_envs import docker_compose

    from llmesh.deploy.compose import main

    path = COMPOSE_FILE
    if layout != "docker-compose.yml":
        path = tmp_path / f"{layout}.yml"
        assert main([*LAYOUTS[layout], "-o", str(path)]) == 0
    done = subprocess.run(
        [*docker_compose(), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]} | OPERATOR_ENV,
    )
    assert done.returncode == 0, done.stderr
    rendered = yaml.safe_load(done.stdout)
    assert rendered["secrets"]["hf-token"]["file"] == OPERATOR_ENV["MESH_HF_TOKEN_FILE"]
    by_module = {module: name for name, module in SERVICES.items()}
    readers = 0
    for name, service in rendered["services"].items():
        module = by_module.get((command(service) or [""])[0])
        env = environment(service)
        if module is None or "MESH_MODEL_DIR" not in env:
            continue
        readers += 1
        assert env["MESH_MODELS"] == OPERATOR_ENV["MESH_MODELS"] and env.get("MESH_MODEL") is None, name
        assert env["HF_TOKEN"] == OPERATOR_ENV["HF_TOKEN"] and env["HF_TOKEN_PATH"] == "/run/secrets/hf-token", name
        assert "hf-token" in [s if isinstance(s, str) else s["source"] for s in service["secrets"]], name
        mounts = [v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in service["volumes"]]
        assert any(m.startswith("/srv/models:/models") for m in mounts), (name, mounts)
        for kind in LAYOUT_SETTINGS.get(module) or (SETTINGS[module],):
            for key in env_names(kind):
                monkeypatch.delenv(key, raising=False)
            for key, value in env.items():
                if value is not None and key != "MESH_SECRETS_DIR":
                    monkeypatch.setenv(key, value)
            settings = kind(_env_file=None)
            assert [m.name for m in settings.catalogue()] == [
                "llama",
                "qwen",
            ] and settings.model == "Llama-3.1-8B-Instruct"
    assert readers >= (0 if layout == "control-plane" else 3), readers


def test_every_layout_sets_only_what_its_services_read(layouts):
    by_module = {module: name for name, module in SERVICES.items()}
    for layout, services in layouts.items():
        for name, service in services.items():
            module = command(service)[:1]
            if module and module[0] in by_module:
                service_name = by_module[module[0]]
                kinds = LAYOUT_SETTINGS.get(service_name) or (SETTINGS[service_name],)
                accepted = set().union(*(env_names(kind) for kind in kinds))
                unknown = sorted(k for k in environment(service) if k.upper() not in accepted)
                assert not unknown, f"{layout}: service {name!r} sets {unknown}"


def test_every_secret_a_service_mounts_is_defined(services, layouts, tmp_path):
    from llmesh.deploy.compose import main

    for name, layout in {
        "docker-compose.yml": yaml.safe_load(COMPOSE_FILE.read_text()),
        **{
            n: yaml.safe_load(open(out).read())
            for n, out in ((n, tmp_path / f"{n}.yml") for n in LAYOUTS)
            if main([*LAYOUTS[n], "-o", str(out)]) == 0
        },
    }.items():
        used = {secret for service in layout["services"].values() for secret in service.get("secrets", [])}
        assert used <= set(layout.get("secrets", {})), (name, used)
    assert "hf-token" in services["decode-worker"]["secrets"]


def test_a_prefill_and_a_decode_worker_on_one_gpu_split_its_memory_and_start_in_turn(layouts):
    services = layouts["one-gpu"]
    prefill, decode = services["prefill-worker-0"], services["decode-worker-0"]
    assert gpu_ids(prefill) == gpu_ids(decode) == ["0"]
    assert environment(prefill)["MESH_GPU_MEMORY_UTILIZATION"] == environment(decode)["MESH_GPU_MEMORY_UTILIZATION"]
    assert float(environment(decode)["MESH_GPU_MEMORY_UTILIZATION"]) == 0.45
    assert decode["depends_on"]["prefill-worker-0"] == {"condition": "service_healthy"}
    assert "prefill-worker-0" not in prefill["depends_on"]


def test_the_cpu_layout_needs_no_gpu_and_with_local_images_no_registry(layouts, tmp_path):
    from llmesh.deploy.compose import main

    services = layouts["cpu"]
    for name in ("prefill-worker", "decode-worker"):
        assert "deploy" not in services[name] and environment(services[name])["MESH_ENFORCE_EAGER"] == "true"
        assert services[name]["build"]["args"] == {"BASE": "llmesh-cpu-base", "ENGINE": "cpu"}
    assert {"jaeger", "prometheus", "grafana"} <= set(services)
    path = tmp_path / "local.yml"
    assert main(["cpu", "--local-images", "-o", str(path)]) == 0
    local = yaml.safe_load(path.read_text())["services"]
    assert not {"jaeger", "prometheus", "grafana"} & set(local)
    assert {s.get("image") for s in local.values()} == {"llmesh:cpu"}  # nothing from a registry
    assert all("OTEL_EXPORTER_OTLP_ENDPOINT" not in environment(s) for s in local.values())
    assert local["redis"]["entrypoint"][-1] == "redis" and "--appendonly" in local["redis"]["command"]


def test_one_host_with_workers_of_several_gpus(layouts):
    services = layouts["single"]
    workers = {name: (gpu_ids(s), environment(s)) for name, s in services.items() if "-worker" in name}
    assert {name: (ids, env["MESH_TENSOR_PARALLEL_SIZE"]) for name, (ids, env) in workers.items()} == {
        "prefill-worker-0": (["0", "1"], "2"),
        "decode-worker-0": (["2"], "1"),
        "decode-worker-1": (["3"], "1"),
    }
    assert all(
        env["MESH_KV_HEADS_PER_CHUNK"] == "4" and env["MESH_WORKER_ID"] == name for name, (_, env) in workers.items()
    )
    assert services["decode-worker-1"]["networks"]["default"]["aliases"] == ["decode-worker"]  # Prometheus's name
    assert {"router", "kv-store", "placement", "prometheus"} <= set(services)


def test_the_control_plane_accepts_leaf_nodes_and_runs_no_engines(layouts, tmp_path):
    from llmesh.deploy.credentials import main

    services = layouts["control-plane"]
    assert not {"kv-store", "prefill-worker", "decode-worker"} & set(services)
    assert {"nats", "redis", "router", "placement", "length-predictor", "jaeger"} <= set(services)
    assert {7422} <= port_numbers(services["nats"]) and {6379} <= port_numbers(services["redis"])
    made = command(services["secrets"])
    assert made[made.index("--tls-host") + 1] == "10.0.0.1"
    assert main([str(tmp_path / "s"), *made[2:]]) == 0
    assert re.search(r"leafnodes \{\n  listen: \"0\.0\.0\.0:7422\"", (tmp_path / "s" / "nats.conf").read_text())


def test_the_control_planes_prometheus_is_written_from_the_one_hosts(layouts):
    from llmesh.deploy.compose import CONTROL_PLANE, control_plane_prometheus

    committed = ROOT / "docker" / "prometheus" / "control-plane.yml"
    assert committed.read_text() == control_plane_prometheus(), (
        f"{committed} is stale: python -m llmesh.deploy.compose prometheus-config -o {committed.relative_to(ROOT)}"
    )
    mounts = {
        source.split("/docker/", 1)[1]: inside
        for source, inside in (
            v.removesuffix(":ro").split(":") for v in layouts["control-plane"]["prometheus"]["volumes"]
        )
    }
    assert mounts == {
        "prometheus/control-plane.yml": "/etc/prometheus/prometheus.yml",
        "prometheus/hosts": "/etc/prometheus/hosts",
    }  # relative to the repository, as the file is
    assert (ROOT / "docker" / "prometheus" / "hosts").is_dir()
    jobs = {job["job_name"]: job for job in yaml.safe_load(committed.read_text())["scrape_configs"]}
    assert jobs.keys() == scrape_targets().keys()  # every job of one host, none more
    for name, job in jobs.items():
        dns = {host for d in job.get("dns_sd_configs", []) for host in d["names"]}
        assert dns <= set(CONTROL_PLANE), f"job {name!r} looks up {dns}, services of no control plane"
        if not dns:
            assert job["file_sd_configs"] == [{"files": ["/etc/prometheus/hosts/*.json"]}], name
    assert (
        jobs["workers"]["metric_relabel_configs"]
        == yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"][-1]["metric_relabel_configs"]
    )  # the same vllm:* names dropped as on one host


def test_a_gpu_hosts_metrics_are_published_and_listed_for_the_control_plane(layouts, tmp_path):
    from llmesh.deploy.compose import JOB_LABEL, main

    path = tmp_path / "hosts" / "10.0.0.2.json"
    assert main([*LAYOUTS["gpu-host"], "--prometheus-targets", "-o", str(path)]) == 0
    groups = json.loads(path.read_text())
    services = layouts["gpu-host"]
    listed = {
        g["labels"]["compose_service"]: (g["targets"], g["labels"][JOB_LABEL], g["labels"]["service"]) for g in groups
    }
    assert listed == {
        "kv-store": (["10.0.0.2:9099"], "kv-store", "kv-store"),
        "prefill-worker-10-0-0-2-0": (["10.0.0.2:9103"], "workers", "prefill-worker"),
        "decode-worker-10-0-0-2-0": (["10.0.0.2:9104"], "workers", "decode-worker"),
    }
    jobs = scrape_targets()
    for name, (targets, job, service) in listed.items():
        inside = {port for _, port in jobs[job]}
        published = {tuple(int(port.split("/")[0]) for port in p.rsplit(":", 2)[-2:]) for p in services[name]["ports"]}
        assert (int(targets[0].rsplit(":", 1)[1]), *inside) in published, (name, published)
        assert (service, *inside) in jobs[job]  # the port it serves /metrics on, as on one host


def test_a_gpu_host_joins_the_control_plane(layouts, tmp_path):
    from llmesh.deploy.credentials import main

    services = layouts["gpu-host"]
    assert set(services) == {
        *("secrets", "nats", "kv-store", "prefill-worker-10-0-0-2-0", "decode-worker-10-0-0-2-0"),
        "host-agent-10-0-0-2-0",
    }
    load_or_create(tmp_path / "s")  # the control plane's set, copied here
    made = command(services["secrets"])
    assert main([str(tmp_path / "s"), *made[2:]]) == 0
    assert "10.0.0.1:7422" in (tmp_path / "s" / "nats.conf").read_text()  # a leaf node of the control plane's
    store = environment(services["kv-store"])
    assert store["MESH_DATA_ADVERTISE_HOST"] == "10.0.0.2" and store["MESH_KV_SHARD"] == "10-0-0-2"
    assert 9200 in port_numbers(services["kv-store"])
    for name, service in services.items():
        if name != "secrets" and name != "nats":
            env = environment(service)
            assert env["MESH_NATS_URL"] == "nats://nats:4222", name  # this host's leaf node
            assert env["MESH_REDIS_URL"] == "redis://10.0.0.1:6379/0", name
            assert "redis" not in service["depends_on"], name
    assert gpu_ids(services["decode-worker-10-0-0-2-0"]) == ["1", "2"]


def test_host_agents_each_with_a_gpu_and_a_budget_that_their_workers_share(layouts, monkeypatch):
    """Each host agent is a Prism device: one GPU, its memory for models, its own host id; the workers it
    starts inherit the engine settings and serve no /metrics port (several share its container)."""
    for layout, expected in (("single", {"host-agent-0": "4", "host-agent-1": "5"}), ("gpu-host", None)):
        agents = {name: s for name, s in layouts[layout].items() if name.startswith("host-agent")}
        if expected:
            assert {name: gpu_ids(s) for name, s in agents.items()} == {n: [g] for n, g in expected.items()}
        for name, service in agents.items():
            env = environment(service)
            assert command(service) == ["llmesh_hostagent"] and env["MESH_HOST_ID"] == name
            assert "MESH_WORKER_METRICS_PORT" not in env and "healthcheck" not in service
            for key in env_names(HostAgentSettings):
                monkeypatch.delenv(key, raising=False)
            monkeypatch.setenv("MESH_HOST_MEMORY_GIB", env["MESH_HOST_MEMORY_GIB"])
            assert HostAgentSettings(_env_file=None).memory_bytes() == {"single": 70, "gpu-host": 40}[layout] * 2**30


@pytest.mark.parametrize(
    "argv, message",
    [
        (["single", "--prefill", "0", "--decode", "1", "--host-agent", "1", "--host-memory-gib", "9"], "host agent's"),
        (["single", "--prefill", "0", "--decode", "1", "--host-agent", "2"], "with --host-memory-gib"),
        (["single", "--prefill", "0", "--decode", "1", "--host-agent", "2,3", "--host-memory-gib", "9"], "one GPU"),
        (["single", "--prefill", "0", "--prefill", "0", "--decode", "1"], "a GPU is given to two prefill workers"),
        (["single", "--prefill", "0,0", "--decode", "1,2"], "given a GPU twice"),
        (["single", "--prefill", "0,1", "--decode", "2"], "--kv-heads-per-chunk"),
        (["single", "--prefill", "0"], "a decode worker at least"),
        (["gpu-host", "--prefill", "0"], "--control-plane and --address"),
    ],
)
def test_layouts_that_cannot_work_are_refused(argv, message, capsys):
    from llmesh.deploy.compose import main

    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "advice, running, expected",
    [
        (0, 2, []),
        (1, 3, []),  # every GPU has a worker
        (-1, 1, []),  # the last one stays
        (1, 1, ["--decode 1 --decode 2", "up"]),
        (-1, 3, ["drain decode-worker-2", "until", "--decode 1 --decode 2 -o", "up"]),
    ],
)
def test_the_scaling_advice_as_compose_commands(advice, running, expected):
    plan = scale_plan(advice, running, "0", ["1", "2", "3"], "scaled.yml")
    assert len(plan) == len(expected) and all(part in line for part, line in zip(expected, plan)), plan


def test_the_scaled_layout_validates_and_names_the_workers_the_plan_drains(tmp_path):
    """The plan's layout command, run as written, gives a file docker-compose accepts, whose decode workers
    are the ones the plan counts and drains."""
    from tool_envs import docker_compose

    from llmesh.deploy.compose import main

    out = tmp_path / "scaled.yml"
    layout, _ = scale_plan(1, 2, "0", ["1", "2", "3", "4"], str(out))
    assert main(shlex.split(layout)[3:]) == 0  # after `python -m llmesh.deploy.compose`
    done = subprocess.run(
        [*docker_compose(), "-f", str(out), "config"], capture_output=True, text=True, env={"PATH": os.environ["PATH"]}
    )
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    decode = {name: gpu_ids(s) for name, s in services.items() if name.startswith("decode-worker")}
    assert decode == {"decode-worker-0": ["1"], "decode-worker-1": ["2"], "decode-worker-2": ["3"]}
    assert services["decode-worker-2"]["restart"] == "on-failure"  # a drained worker's exit 0 leaves it down
