"""A burst past capacity against a running mesh, as a client sees it (issue 32):

    make run &    # then, once /health says ok:
    .venv/bin/python bench/burst.py --requests 800 --connections 600

Sends every request at once (every other one streamed, 64-256 output tokens) and counts what came
back: 200s streamed to [DONE] or whole, refusals by status and code, and any error after a 200 (an
SSE error event, or a stream cut without [DONE]), with the spread of `Retry-After`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from pathlib import Path

import httpx


async def one(client: httpx.AsyncClient, url: str, model: str, i: int) -> tuple[object, str, str | None]:
    """(status or outcome, detail, Retry-After) of request `i`."""
    body = {
        "model": model,
        "prompt": f"Tell me a story number {i} about " + "the sea " * (i % 50),
        "max_tokens": 64 + (i % 4) * 64,
        "stream": i % 2 == 0,
    }
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            lines = [line async for line in resp.aiter_lines()]
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
        results = await asyncio.gather(*(one(client, args.url, args.model, i) for i in range(args.requests)))
    print(f"{args.requests} requests over {args.connections} connections in {time.monotonic() - started:.1f} s")
    for (outcome, detail), count in collections.Counter((r[0], r[1]) for r in results).most_common():
        print(f"  {outcome} {detail}: {count}")
    waits = sorted(int(r[2]) for r in results if r[2] is not None)
    if waits:
        print(f"  Retry-After: min {waits[0]}, median {waits[len(waits) // 2]}, max {waits[-1]} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key-file", type=Path, default=Path(".mesh-secrets/api-key"))
    parser.add_argument("--model", default="llmesh/tiny-llama")
    parser.add_argument("--requests", type=int, default=800)
    parser.add_argument("--connections", type=int, default=600)
    parser.add_argument("--timeout", type=float, default=400.0, help="seconds a client waits for its answer")
    asyncio.run(main(parser.parse_args()))
