"""The operator's view of the placement service:

    python -m llmesh_placement.cli [--nats URL] workers | requests | drain WORKER | migrate REQUEST [--to WORKER]
                                   | role WORKER prefill|decode

Prints what the leading placement replica answers; exits 1 with the reason when a command fails
or no placement service answers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from llmesh.deploy.compose import scale_plan
from llmesh.policies.banaserve import switchable
from llmesh.policies.llumnix import freeness
from llmesh.policies.views import worker_view
from llmesh.wire.bus import Bus
from llmesh.wire.config import CommonSettings
from llmesh.wire.errors import MeshError, ServiceUnavailable, Timeout
from llmesh.wire.messages import PlacementDecision, PlacementRequest, PlacementStatus, Subjects
from llmesh.wire.secrets import operator_nats_url

SCALING = {1: "add a decode instance (+1)", -1: "a decode instance can go (-1)", 0: "hold (0)"}


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def workers_table(status: PlacementStatus) -> str:
    rows, switchables = [], 0
    for info in status.workers:
        view = worker_view(info)
        kv = f"{info.kv_blocks_used}/{info.kv_blocks_total}" if info.kv_blocks_total else "-"
        free = f"{freeness(view):.1f}" if info.kv_blocks_total and info.state == "active" else "-"
        switchables += switchable(view)
        rows.append(
            (
                info.worker_id,
                info.role + "*" * switchable(view),
                info.state,
                f"{info.running}/{info.capacity}",
                kv,
                free,
                len(info.requests),
            )
        )
    header = ("WORKER", "ROLE", "STATE", "RUNNING", "KV BLOCKS", "FREENESS", "REQUESTS")
    lines = [
        table(header, rows) if rows else "no live workers",
        "",
        *(["* built with both roles: `role WORKER prefill|decode` switches it"] if switchables else []),
        f"leader {status.leader}; scaling advice: {SCALING.get(status.scaling, status.scaling)}",
    ]
    if status.decisions:
        lines.append("decisions: " + ", ".join(f"{k}={n}" for k, n in sorted(status.decisions.items())))
    return "\n".join(lines)


def requests_table(status: PlacementStatus) -> str:
    rows = [
        (
            r.request_id,
            info.worker_id,
            r.prompt_tokens,
            r.generated,
            r.max_tokens,
            r.priority,
            "yes" if r.migrating else "",
        )
        for info in status.workers
        for r in info.requests
    ]
    if not rows:
        return "no requests"
    return table(("REQUEST", "WORKER", "PROMPT", "GENERATED", "MAX", "PRIORITY", "MIGRATING"), rows)


def event_line(event: PlacementDecision) -> str:
    """One activation, eviction or drain, with the numbers it was decided on."""
    d = event.detail
    model, role, host, worker = d.get("model"), d.get("role"), d.get("host"), d.get("worker_id")
    if event.kind == "activate":
        parked = f", {d['parked']} parked" if d.get("parked") else ""
        kv = f", KV {d['kv_cache_bytes'] / 2**30:.2f} GiB" if d.get("kv_cache_bytes") else ""
        what = f"activate {model} {role} on {host} as {worker} ({event.reason}{parked}{kv})"
    else:
        idle = f", idle {d['idle_s']} s, for {d.get('for')}" if "idle_s" in d else ""
        what = f"{event.kind} {worker} ({model} {role} on {host}, {event.reason}{idle})"
    if "kvpr_before" in d:
        what += f": KVPR {d['kvpr_before']:.3g} -> {d['kvpr_after']:.3g}"
    if "decode_workers" in d:
        what += f": mean freeness {d.get('mean_freeness')} over {d['decode_workers']} decode workers"
    return f"{what}: {d.get('outcome')} {d.get('how') or d.get('refusal') or ''}".rstrip()


def models_table(status: PlacementStatus) -> str:
    """The hosts, the catalogue's models, and placement's latest decisions about them with their inputs."""
    gib = lambda n: f"{n / 2**30:.1f}"  # noqa: E731
    hosts = [
        (h.host_id, gib(h.memory_bytes), " ".join(f"{r}={n}" for r, n in sorted(h.standbys.items())), len(h.workers))
        for h in status.hosts
    ]
    models = [
        (m.name, f"{m.rate:.2f}", m.parked, "-" if m.idle_s == float("inf") else f"{m.idle_s:.0f}", ",".join(m.hosts))
        for m in status.models
    ]
    lines = [
        table(("HOST", "GIB FOR MODELS", "STANDBYS READY", "WORKERS STARTED"), hosts)
        if hosts
        else "no host agent reports: placement activates nothing",
        "",
        table(("MODEL", "REQ/S", "PARKED", "IDLE S", "ON HOSTS"), models) if models else "no models",
    ]
    lines += [event_line(e) for e in status.events]
    return "\n".join(lines)


async def ask(nats_url: str, request: PlacementRequest, timeout: float) -> PlacementStatus:
    bus = await Bus.connect(nats_url, "placement-cli", connect_timeout=timeout)
    try:
        status, _ = await bus.request(Subjects.PLACEMENT, request, PlacementStatus, timeout=timeout)
        return status
    finally:
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmesh_placement.cli",
        description="Ask the leading placement replica about workers and requests, "
        "or have it drain a worker, move a request or switch a worker's role.",
    )
    parser.add_argument("--nats", default=None, help="NATS URL (default: MESH_NATS_URL or nats://127.0.0.1:4222)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the answer (default: 5; 20 for migrate and role, which wait "
        "for the worker's hand-shake)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("workers", help="live workers, their load and freeness, and the scaling advice")
    commands.add_parser("requests", help="requests the workers hold")
    scale = commands.add_parser(
        "compose-scale",
        help="the commands that carry out the scaling advice on a one-host compose deployment (its decode "
        "workers decode-worker-0, -1, ... on one GPU each): print them for an operator's controller to run",
    )
    scale.add_argument("--prefill", required=True, metavar="GPUS", help="the prefill worker's GPU ids, e.g. 0")
    scale.add_argument(
        "--decode-gpus", nargs="+", required=True, metavar="GPU", help="the GPUs decode workers may have, in order"
    )
    scale.add_argument("-o", "--out", default="docker-compose.scaled.yml", help="the compose file to write")
    commands.add_parser("models", help="hosts, models (rate, parked requests, where they run) and the latest decisions")
    drain = commands.add_parser("drain", help="drain a worker: its requests move away, then it exits")
    drain.add_argument("worker")
    migrate = commands.add_parser("migrate", help="move a request to another decode worker now")
    migrate.add_argument("request")
    migrate.add_argument("--to", dest="target", default=None, help="the target worker (default: the freest)")
    role = commands.add_parser("role", help="have a worker built with both roles serve the other one now")
    role.add_argument("worker")
    role.add_argument("role", choices=("prefill", "decode"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the bus's reconnect warnings are not the operator's business

    request = {
        "workers": PlacementRequest(op="status"),
        "requests": PlacementRequest(op="status"),
        "models": PlacementRequest(op="status"),
        "compose-scale": PlacementRequest(op="status"),
        "drain": PlacementRequest(op="drain", worker_id=getattr(args, "worker", None)),
        "migrate": PlacementRequest(
            op="migrate", request_id=getattr(args, "request", None), target=getattr(args, "target", None)
        ),
        "role": PlacementRequest(op="role", worker_id=getattr(args, "worker", None), role=getattr(args, "role", None)),
    }[args.command]
    timeout = args.timeout or (20.0 if args.command in ("migrate", "role") else 5.0)
    nats_url = operator_nats_url(args.nats or CommonSettings().nats_url)
    try:
        status = asyncio.run(ask(nats_url, request, timeout))
    except Timeout:
        print(
            f"placement: no placement service answered on {Subjects.PLACEMENT} within {timeout:.0f}s "
            "(none running, or none holds the leader lease)",
            file=sys.stderr,
        )
        return 1
    except ServiceUnavailable as exc:
        if exc.message.endswith(Subjects.PLACEMENT):  # no responders: nothing subscribes
            print(f"placement: no placement service is running ({exc.message})", file=sys.stderr)
        else:
            print(f"placement: {exc.message}", file=sys.stderr)
        return 1
    except MeshError as exc:
        print(f"placement: {exc.message}", file=sys.stderr)
        return 1
    if args.command == "workers":
        print(workers_table(status))
    elif args.command == "requests":
        print(requests_table(status))
    elif args.command == "models":
        print(models_table(status))
    elif args.command == "compose-scale":
        running = sum(w.role == "decode" and w.state == "active" for w in status.workers)
        plan = scale_plan(status.scaling, running, args.prefill, args.decode_gpus, args.out)
        print("\n".join(plan) or f"# hold: advice {SCALING.get(status.scaling)}, {running} decode workers")
    else:
        print(status.message)
    return 0


if __name__ == "__main__":
    sys.exit(main())
