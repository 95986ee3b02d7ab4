"""A burst past capacity against a running mesh, as a client sees it (issue 32):

    make run &    # then, once /health says ok:
    .venv/bin/python bench/burst.py --requests 800 --connections 600

Sends every request at once (every other one streamed, 64-256 output tokens) and counts what came
back: 200s streamed to [DONE] or whole, refusals by status and code, and any error after a 200 (an
SSE error event, or a stream cut without [DONE]), with the spread of `Retry-After`. With `--spans DIR`
(the router's MESH_TRACE_DIR) it splits each answer's time as the client saw it into the client's wait for a
connection of its pool and its write, from the write to the router's read of its first byte (the kernel's
queues, the router's accepting), the router's wait from that byte to its handler (its event loop busy), and
the router's handling.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx


@dataclass
class Timed:
    """When the client began a request, had written it (its pool gave it a connection) and had its answer
    (epoch seconds), and the router's id for it."""

    began: float = 0.0
    sent: float = 0.0
    ended: float = 0.0
    request_id: str = ""

    async def trace(self, event: str, info: dict) -> None:  # httpcore's trace extension
        if event == "http11.send_request_body.complete":
            self.sent = time.time()


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, timed: Timed) -> tuple[object, str, str | None]:
    """(status or outcome, detail, Retry-After) of request `i`."""
    body = {
        "model": model,
        "prompt": f"Tell me a story number {i} about " + "the sea " * (i % 50),
        "max_tokens": 64 + (i % 4) * 64,
        "stream": i % 2 == 0,
    }
    timed.began = time.time()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, extensions={"trace": timed.trace}) as resp:
            timed.request_id = resp.headers.get("x-request-id", "")
            lines = [line async for line in resp.aiter_lines()]
        timed.ended = time.time()
    except httpx.HTTPError as exc:
        return "client error", type(exc).__name__, None
    if resp.status_code != 200:
        return resp.status_code, json.loads("".join(lines))["error"]["code"], resp.headers.get("retry-after")
    if not body["stream"]:
        return 200, "whole", None
    events = [line[6:] for line in lines if line.startswith("data: ")]
    errors = [json.loads(e)["error"]["code"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    if errors:
        return "error after 200", errors[0], None
    if not events or events[-1] != "[DONE]":
        return "cut after 200", "no [DONE]", None
    return 200, "streamed", None


async def main(args: argparse.Namespace) -> None:
    key = args.api_key_file.read_text().strip()
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        started = time.monotonic()
        timed = [Timed() for _ in range(args.requests)]
        results = await asyncio.gather(*(one(client, args.url, args.model, i, timed[i]) for i in range(args.requests)))
    print(f"{args.requests} requests over {args.connections} connections in {time.monotonic() - started:.1f} s")
    for (outcome, detail), count in collections.Counter((r[0], r[1]) for r in results).most_common():
        print(f"  {outcome} {detail}: {count}")
    waits = sorted(int(r[2]) for r in results if r[2] is not None)
    if waits:
        print(f"  Retry-After: min {waits[0]}, median {waits[len(waits) // 2]}, max {waits[-1]} s")
    if args.spans:
        split_by_stage(results, timed, router_spans(args.spans))


def router_spans(folder: Path) -> dict[str, tuple[float, float, float]]:
    """(start, end epoch s, wait before the handler s) of each request's "router request" span, by request id."""
    out = {}
    for path in folder.glob("router-*.jsonl"):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            if span.get("name") == "router request":
                start, end = (datetime.fromisoformat(span[k]).timestamp() for k in ("start_time", "end_time"))
                out[span["attributes"]["request.id"]] = (start, end, span["attributes"].get("http.wait_s", 0.0))
    return out


def split_by_stage(results: list, timed: list[Timed], spans: dict[str, tuple[float, float, float]]) -> None:
    """P50 and P99 of each stage of the answers the router's spans name, by outcome."""

    def pct(values: list[float], p: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else float("nan")

    for outcome in sorted({r[0] for r in results}, key=str):
        rows = [(t, spans[t.request_id]) for r, t in zip(results, timed) if r[0] == outcome and t.request_id in spans]
        if not rows:
            continue
        stages = {
            "client": [t.ended - t.began for t, _ in rows],
            "client's wait for a connection and its write": [t.sent - t.began for t, _ in rows],
            "written to the router's first read": [s[0] - t.sent for t, s in rows],
            "router's wait for its handler": [s[2] for _, s in rows],
            "router": [s[1] - s[0] for _, s in rows],
        }
        cells = ", ".join(f"{name} {pct(v, 50):.1f} / {pct(v, 99):.1f}" for name, v in stages.items())
        print(f"  {outcome} ({len(rows)} with spans), P50 / P99 s: {cells}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key-file", type=Path, default=Path(".mesh-secrets/api-key"))
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--connections", type=int, default=600)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds a client waits for its answer")
    parser.add_argument("--spans", type=Path, help="the router's span files (its MESH_TRACE_DIR)")
    asyncio.run(main(parser.parse_args()))
