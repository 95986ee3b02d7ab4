"""KV in head-group chunks against whole-layer chunks, through the kv-store's data plane.

    .venv/bin/python bench/head_groups.py [--model 8b|tiny] [--blocks 32] [--reps 5]

One request's KV moves as the connector moves it: per layer, one put (prefill's save) and then
one get (decode's load) of all its blocks' chunks. With whole-layer chunks a block of a layer is
one chunk; with head groups of `g` heads it is `heads / g` chunks of `g` heads each: the same
bytes in more, smaller values. Timed per request (every layer), both layouts alternating in one
run, over shared memory (a worker on the shard's host) and TCP (across hosts); medians of
`--reps` and their range, and the ratio to whole-layer chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from llmesh.deploy.launcher import start_nats, start_service
from llmesh.wire.kvkeys import chunk_key

# (layers, KV heads, head size, tokens a block): Llama-3.1-8B with vLLM's GPU block of 16, and
# the embedded tiny model with the CPU block of 128; bf16, K and V
MODELS = {"8b": (32, 8, 128, 16), "tiny": (4, 4, 32, 128)}


def request_times(
    kv, layers: int, blocks: int, heads: int, head_bytes: int, per_chunk: int, tag: str, reps: int
) -> tuple[list[float], list[float]]:
    groups = heads // per_chunk
    value = os.urandom(per_chunk * head_bytes)
    puts, gets = [], []
    for rep in range(reps):
        keys = [
            [chunk_key(f"{tag}-{rep}-{b}", layer, g) for b in range(blocks) for g in range(groups)]
            for layer in range(layers)
        ]
        start = time.perf_counter()
        for layer_keys in keys:
            kv.put(layer_keys, [value] * len(layer_keys))
        puts.append(time.perf_counter() - start)
        start = time.perf_counter()
        for layer_keys in keys:
            with kv.get(layer_keys) as got:
                assert all(v is not None and len(v) == len(value) for v in got)
        gets.append(time.perf_counter() - start)
    return puts, gets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="8b")
    parser.add_argument("--blocks", type=int, default=32, help="blocks a request (8b: 512 tokens)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    layers, heads, head_size, tokens = MODELS[args.model]
    head_bytes = 2 * tokens * head_size * 2  # one head of one block of one layer: K and V, bf16
    work = Path(tempfile.mkdtemp(prefix="llmesh-headbench-"))
    nats, url = start_nats(work, log_path=work / "nats.log")
    store = start_service(
        "kv-store",
        {
            "MESH_NATS_URL": url,
            "MESH_CAPACITY_BYTES": str(6 * 1024**3),
            "MESH_SSD_CAPACITY_BYTES": "0",
            "MESH_DATA_DIR": str(work / "kv-data"),
        },
        work / "kv-store.log",
    )
    from llmesh.engine.kvclient import KvClient, ShardDirectory
    from llmesh.wire.bus import Bus

    async def connect():
        bus = await Bus.connect(url, "bench-heads")
        directory = ShardDirectory(bus)
        await directory.start()
        return bus, directory

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        time.sleep(1)
        bus, directory = asyncio.run_coroutine_threadsafe(connect(), loop).result()
        sizes = sorted({g for g in (heads, heads // 2, heads // 4, 1) if g >= 1}, reverse=True)
        request_mib = layers * args.blocks * heads * head_bytes / 2**20
        print(
            f"{args.model}: {layers} layers, {heads} KV heads, {tokens}-token blocks, {args.blocks} blocks: "
            f"{request_mib:.1f} MiB a request; whole-layer chunk {heads * head_bytes // 1024} KiB"
        )
        rows = []
        for mode in ("shm", "tcp"):
            kv = KvClient(directory, use_shm=mode == "shm")
            kv.put(["warm"], [b"x" * 1024])
            times = {g: ([], []) for g in sizes}
            for round_ in range(args.reps):  # alternate the layouts, so drift hits them alike
                for g in sizes:
                    p, q = request_times(kv, layers, args.blocks, heads, head_bytes, g, f"{mode}-{g}-{round_}", 1)
                    times[g][0].extend(p)
                    times[g][1].extend(q)
            kv.close()
            for g in sizes:
                puts, gets = times[g]
                rows.append((mode, g, puts, gets))
        base = {mode: (statistics.median(p), statistics.median(q)) for mode, g, p, q in rows if g == heads}
        print(
            "\n| path | heads a chunk | chunks a request | put ms median [range] | get ms median [range] | "
            "put / whole-layer | get / whole-layer |\n|---|---|---|---|---|---|---|"
        )
        for mode, g, puts, gets in rows:
            put, get = statistics.median(puts), statistics.median(gets)
            print(
                f"| {mode} | {g}{' (whole layer)' if g == heads else ''} | {layers * args.blocks * heads // g} | "
                f"{put * 1e3:.1f} [{min(puts) * 1e3:.1f}-{max(puts) * 1e3:.1f}] | "
                f"{get * 1e3:.1f} [{min(gets) * 1e3:.1f}-{max(gets) * 1e3:.1f}] | "
                f"{put / base[mode][0]:.2f} | {get / base[mode][1]:.2f} |"
            )
        asyncio.run_coroutine_threadsafe(bus.close(), loop).result()
    finally:
        store.stop()
        nats.stop()


if __name__ == "__main__":
    main()
