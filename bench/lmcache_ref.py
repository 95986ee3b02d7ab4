"""LMCache's lm:// reference server (or any lm:// endpoint) measured with LMCache's own client.

Run with LMCache's isolated venv (`python tests/tool_envs.py lmcache` builds it and prints its python):

    .cache/lmcache-venv/bin/python bench/lmcache_ref.py                  # starts `python -m lmcache.v1.server`
    .venv/bin/python -m llmesh_kvstore.lmcache_protocol --port 65432 &   # the kv-store's lm:// endpoint ...
    .cache/lmcache-venv/bin/python bench/lmcache_ref.py --server 127.0.0.1:65432 --system llmesh-lm

For values of 64 KiB, 1 MiB and 4 MiB, with 1 and 4 clients (each its own process with its own
LMCServerConnector), every client puts ~96 MiB of distinct keys, then gets them all back. Prints one
JSON object per configuration and op: gbps is bytes moved by all clients (GB = 1e9 bytes) over the
wall time from the common start to the last client's end; p50_ms/p99_ms are per-operation latencies.
LMCache's PUT has no reply, so a put is timed until the data is handed to the socket, and each client
ends its put phase with an EXIST round trip, which the server answers only after every earlier PUT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import time

SIZES = [64 * 1024, 1024**2, 4 * 1024**2]
CLIENTS = [1, 4]
BYTES_PER_CLIENT = 96 * 1024**2
WARMUP = 4


def _client(host: str, port: int, size: int, count: int, base: int, barrier, results) -> None:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    async def run() -> dict:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256, local_cpu=False, max_local_cpu_size=max(0.1, 4 * size / 1024**3)
        )
        metadata = LMCacheMetadata(
            model_name="bench",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(1, 2, 256, 4, 16),
        )
        backend = LocalCPUBackend(config, metadata)
        conn = LMCServerConnector(host, port, asyncio.get_running_loop(), backend)
        obj = backend.allocate(torch.Size([2, size // 65536, 256, 64]), torch.bfloat16, MemoryFormat.KV_2LTD)
        assert len(obj.byte_array) == size
        obj.tensor.copy_(torch.randn(obj.tensor.shape).to(torch.bfloat16))
        keys = [CacheEngineKey("bench", 1, 0, base + i, torch.bfloat16) for i in range(WARMUP + count)]
        for key in keys[:WARMUP]:
            await conn.put(key, obj)
            (await conn.get(key)).ref_count_down()
        out = {}
        for op in ("put", "get"):
            barrier.wait()
            lat = []
            start = time.perf_counter()
            for key in keys[WARMUP:]:
                t0 = time.perf_counter()
                if op == "put":
                    await conn.put(key, obj)
                else:
                    got = await conn.get(key)
                    assert got is not None and len(got.byte_array) == size, "get missed"
                    got.ref_count_down()
                lat.append(time.perf_counter() - t0)
            if op == "put":
                assert await conn.exists(keys[-1]), "last put not stored"
            out[op] = (start, time.perf_counter(), lat)
        await conn.close()
        return out

    results.put(asyncio.run(run()))


def _measure(host: str, port: int, size: int, clients: int, base: int, system: str) -> None:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(clients), ctx.Queue()
    count = BYTES_PER_CLIENT // size
    procs = [
        ctx.Process(target=_client, args=(host, port, size, count, base + c * 2**32, barrier, results))
        for c in range(clients)
    ]
    for p in procs:
        p.start()
    outs = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a client failed ({p.exitcode})")
    for op in ("put", "get"):
        start = min(o[op][0] for o in outs)
        end = max(o[op][1] for o in outs)
        lat = sorted(x for o in outs for x in o[op][2])
        print(
            json.dumps(
                {
                    "system": system,
                    "size": size,
                    "clients": clients,
                    "op": op,
                    "gbps": round(size * len(lat) / (end - start) / 1e9, 3),
                    "p50_ms": round(statistics.median(lat) * 1e3, 3),
                    "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 3),
                }
            ),
            flush=True,
        )


def _start_reference(host: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", host, str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("LMCache's reference server did not start") from None
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", help="host:port of a running lm:// server (default: start LMCache's)")
    parser.add_argument("--system", help="label in the output (default: lmcache-ref, or lm://<server>)")
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="value sizes, multiples of 64 KiB")
    parser.add_argument("--clients", type=int, nargs="+", default=CLIENTS)
    args = parser.parse_args()
    ref = None
    if args.server:
        host, port = args.server.rsplit(":", 1)
        port = int(port)
    else:
        host = "127.0.0.1"
        ref, port = _start_reference(host)
    system = args.system or ("lmcache-ref" if ref else f"lm://{args.server}")
    base = time.time_ns() & (2**60 - 1) & ~(2**40 - 1)  # fresh keys on every run against a long-lived server
    try:
        for i, size in enumerate(args.sizes):
            for j, clients in enumerate(args.clients):
                _measure(host, port, size, clients, base + (i * len(args.clients) + j) * 2**36, system)
    finally:
        if ref is not None:
            ref.terminate()
            ref.wait()


if __name__ == "__main__":
    main()
