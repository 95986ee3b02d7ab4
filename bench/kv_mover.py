"""The connector's KV movement inside model-shaped steps, against the same steps without it, on a GPU.

    python bench/kv_mover.py [--out FILE.json] [--repeats 10] [--smoke] [shape flags: --layers 32 ...]

Imports only torch, numpy and `shared/engine/kv_mover.py` (by path: no vLLM, no NATS, no installed llmesh),
so it runs unchanged on a GPU machine that has nothing else; `--smoke` runs small shapes on whatever
device there is (CPU in `make test`). Default shapes: Llama-3.1-8B in bf16, vLLM's GPU block of 16
tokens and its default physical KV layout (NHD: per layer `[blocks, tokens, KV heads, K|V]`, viewed
as `[blocks, KV heads, tokens, K|V]`).

A step runs every layer as a model does (QKV projection, attention, output projection, MLP; one
layer's weights serve all, which changes no cost), writing the new tokens' K and V into the paged
cache, and calls the connector's hooks where vLLM calls them: `wait_for_layer_load` before
attention, `save_kv_layer` after it, `wait_for_save` after the forward. On a GPU a decode step runs as
vLLM runs a model with a KV connector, in piecewise CUDA graphs (each layer's work before and after
attention replayed from a graph, attention and the hooks eager), and eagerly too. Rows, each against
the same step with no hooks, alternating A/B `--repeats` times (medians and ranges; ratio = median
with / median without):

- decode write-behind: `--decode-batch` requests at `--decode-context` tokens, `--decode-written`
  blocks written behind a step: after the forward, every layer's blocks gathered at once and
  written to host memory by a transfer thread, not waited for (as `KvMover` and the connector do
  it), and as the connector did before `KvMover` (`cache[ids].cpu()` a layer).
- prefill save: each `--prefill-tokens` prompt's blocks saved layer by layer and waited for at the
  step's end (a prefill's `wait_for_save`); before: a thread copying block by block into pageable
  buffers while the step waits.
- load: one `--load-tokens` request's KV, every layer, from host memory into the cache (one
  host-to-device copy and one indexed copy a layer), from registered shared memory, pinned and
  pageable buffers.
- copy bandwidth, GPU<->host, `--copy-mib` in one copy: pinned (`pin_memory`), a /dev/shm mapping
  registered with CUDA (as the kv-store's arena on a GPU host), pageable.

Saves go to a /dev/shm mapping registered with CUDA (the kv-store's arena on a GPU host), from a
thread pool (the connector's transfer threads). With a GPU, the hooks run under
`torch.cuda.set_sync_debug_mode("error")`: a call that makes the host wait for the GPU fails the run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import mmap
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent


def load_mover():
    spec = importlib.util.spec_from_file_location("kv_mover", ROOT / "shared" / "engine" / "kv_mover.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_mover"] = module
    spec.loader.exec_module(module)
    return module


kv_mover = load_mover()
SMOKE = dict(
    layers=2,
    hidden=256,
    heads=4,
    kv_heads=2,
    head_dim=64,
    intermediate=512,
    block_size=16,
    decode_batch=4,
    decode_context=256,
    decode_written=2,
    prefill_tokens=[256],
    load_tokens=256,
    copy_mib=8,
    repeats=2,
    steps=2,
)


class SharedMemory:
    """A /dev/shm mapping, as the kv-store's arena, registered with CUDA through `HostMemory` (where
    /dev/shm is too small, as in a container's default 64 MiB, an anonymous mapping, said so)."""

    def __init__(self, size: int, memory) -> None:
        shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        self.kind = "/dev/shm" if shm and shm.f_bavail * shm.f_frsize > size + (256 << 20) else "anonymous"
        if self.kind == "anonymous":
            print(f"/dev/shm has no room for {size >> 20} MiB: an anonymous mapping instead", flush=True)
            self._map = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        else:
            path = Path("/dev/shm") / f"llmesh-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
                path.unlink()
        self.view, self._memory = memoryview(self._map), memory
        memory.register(self.view)

    def close(self) -> None:
        self._memory.unregister(self.view)
        self.view.release()
        self._map.close()


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[], None]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


class Model:
    """One transformer layer's weights, run as every layer; the paged KV cache, one view a layer."""

    def __init__(self, args, device: torch.device, num_blocks: int):
        d, dtype = device, torch.bfloat16
        self.args, self.device = args, device
        qkv = (args.heads + 2 * args.kv_heads) * args.head_dim
        self.wqkv = torch.randn(args.hidden, qkv, device=d, dtype=dtype) * 0.02
        self.wo = torch.randn(args.heads * args.head_dim, args.hidden, device=d, dtype=dtype) * 0.02
        self.wgu = torch.randn(args.hidden, 2 * args.intermediate, device=d, dtype=dtype) * 0.02
        self.wd = torch.randn(args.intermediate, args.hidden, device=d, dtype=dtype) * 0.02
        # NHD physically, viewed [blocks, KV heads, tokens, K|V] as vLLM 0.32 hands them to a connector
        buffer = torch.randn(
            args.layers, num_blocks, args.block_size, args.kv_heads, 2 * args.head_dim, device=d, dtype=dtype
        )
        self.caches = {layer: buffer[layer].permute(0, 2, 1, 3) for layer in range(args.layers)}

    def qkv(self, x: torch.Tensor):
        a = self.args
        q, k, v = (x @ self.wqkv).split([a.heads * a.head_dim, a.kv_heads * a.head_dim, a.kv_heads * a.head_dim], -1)
        return q, k, v

    def rest(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + attended @ self.wo
        gate, up = (x @ self.wgu).chunk(2, -1)
        return x + (F.silu(gate) * up) @ self.wd

    def prefill(self, x: torch.Tensor, blocks: torch.Tensor, hooks) -> torch.Tensor:
        """One prompt of `len(x)` tokens into `blocks` (whole blocks)."""
        a, tokens = self.args, x.shape[0]
        for layer in range(a.layers):
            hooks.before(layer)
            q, k, v = self.qkv(x)
            kv = torch.cat([k.view(tokens, a.kv_heads, a.head_dim), v.view(tokens, a.kv_heads, a.head_dim)], -1)
            self.caches[layer].index_copy_(
                0, blocks, kv.view(-1, a.block_size, a.kv_heads, 2 * a.head_dim).permute(0, 2, 1, 3)
            )
            o = F.scaled_dot_product_attention(
                q.view(1, tokens, a.heads, a.head_dim).transpose(1, 2),
                k.view(1, tokens, a.kv_heads, a.head_dim).transpose(1, 2),
                v.view(1, tokens, a.kv_heads, a.head_dim).transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )
            hooks.after(layer)
            x = self.rest(x, o.transpose(1, 2).reshape(tokens, -1))
        return x

    def decode(
        self,
        x: torch.Tensor,
        context: tuple[torch.Tensor, torch.Tensor],
        slots: tuple[torch.Tensor, ...],
        hooks,
        pieces: Pieces | None = None,
    ) -> torch.Tensor:
        """One token for each of `len(x)` requests attending to their contexts (dense K and V, read as a
        paged kernel reads them); the new tokens' K and V written into their cache slots. With `pieces`,
        each layer's work before and after attention is replayed from CUDA graphs, as vLLM runs it."""
        a, batch = self.args, x.shape[0]
        keys, values = context
        block_of, slot_of = slots
        if pieces is not None:
            pieces.x.copy_(x)
        for layer in range(a.layers):
            hooks.before(layer)
            if pieces is None:
                q, k, v = self.qkv(x)
            else:
                pieces.into_layer.replay()
                q, k, v = pieces.qkv
            self.caches[layer][block_of, :, slot_of] = torch.cat(
                [k.view(batch, a.kv_heads, a.head_dim), v.view(batch, a.kv_heads, a.head_dim)], -1
            )
            o = F.scaled_dot_product_attention(
                q.view(batch, 1, a.heads, a.head_dim).transpose(1, 2), keys, values, enable_gqa=True
            )
            hooks.after(layer)
            if pieces is None:
                x = self.rest(x, o.transpose(1, 2).reshape(batch, -1))
            else:
                pieces.attended.copy_(o.transpose(1, 2).reshape(batch, -1))
                pieces.out_of_layer.replay()
        return x if pieces is None else pieces.x


class Pieces:
    """vLLM's piecewise CUDA graphs, the mode it runs a model in with a KV connector: each layer's work
    before attention and after it replayed from a graph; attention and the connector's hooks run
    eagerly between them (a decode batch's size, as vLLM captures them)."""

    def __init__(self, model: Model, x: torch.Tensor):
        self.x = x.clone()
        self.attended = torch.zeros(x.shape[0], model.args.heads * model.args.head_dim, device=x.device, dtype=x.dtype)
        warm = torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            model.qkv(self.x), model.rest(self.x, self.attended)
        torch.cuda.current_stream().wait_stream(warm)
        self.into_layer, self.out_of_layer = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.into_layer):
            self.qkv = model.qkv(self.x)
        with torch.cuda.graph(self.out_of_layer):
            self.x.copy_(model.rest(self.x, self.attended))


class NoHooks:
    def before(self, layer: int) -> None:
        pass

    def after(self, layer: int) -> None:
        pass

    def end(self, wait: bool) -> None:
        pass


class PrefillSaves(NoHooks):
    """`save_kv_layer` for a prefill as the connector does it: the layer's blocks gathered, written into
    registered host memory by a transfer thread; `end` as `wait_for_save`, waiting for the writes."""

    def __init__(self, mover, ids: torch.Tensor, target: memoryview, pool, check: SyncCheck):
        self.mover, self.ids, self.pool, self.check, self.target = mover, ids, pool, check, target
        per_layer = len(target) // len(mover.caches)
        self.runs = {
            layer: [(range(len(ids)), target[layer * per_layer : (layer + 1) * per_layer])] for layer in mover.caches
        }
        self.writes: list[concurrent.futures.Future] = []

    def after(self, layer: int) -> None:
        gathered = self.check.run(lambda: self.mover.gather(layer, self.ids, stable=True))
        self.writes.append(self.pool.submit(gathered.write, self.runs[layer], 1))

    def end(self, wait: bool) -> None:
        for write in self.writes:
            write.result()
        self.writes.clear()


class WriteBehind(NoHooks):
    """A decode's write-behind as the connector does it: after the forward (`wait_for_save`), the blocks
    that filled, every layer, gathered at once and written into registered host memory by a transfer
    thread, not waited for (the oldest write is, once a few steps are outstanding, as memory would be)."""

    def __init__(self, mover, ids: torch.Tensor, target: memoryview, pool, check: SyncCheck):
        self.mover, self.ids, self.pool, self.check, self.target = mover, ids, pool, check, target
        self.writes: list[concurrent.futures.Future] = []

    def end(self, wait: bool) -> None:
        gathered = self.check.run(lambda: self.mover.gather_layers(self.ids))
        self.writes.append(
            self.pool.submit(gathered.write, [(range(len(self.mover.caches) * len(self.ids)), self.target)], 1)
        )
        while self.writes and (wait or len(self.writes) > 4):
            self.writes.pop(0).result()


class OldWriteBehind(NoHooks):
    """What the connector did before `KvMover`: `cache[ids].cpu()` after each layer."""

    def __init__(self, caches: dict, ids: torch.Tensor):
        self.caches, self.ids = caches, ids

    def after(self, layer: int) -> None:
        self.caches[layer][self.ids].cpu()


class OldPrefillSaves(NoHooks):
    """What the connector did before for a prefill: a thread copying each block into a pageable buffer
    (one synchronous device-to-host copy a block); the step waited for them."""

    def __init__(self, caches: dict, ids: list[int], pool):
        self.caches, self.ids, self.pool = caches, ids, pool
        block = caches[0][0]
        self.buffers = {layer: [torch.empty(block.shape, dtype=block.dtype) for _ in ids] for layer in caches}
        self.copies: list[concurrent.futures.Future] = []

    def after(self, layer: int) -> None:
        cache, buffers = self.caches[layer], self.buffers[layer]
        self.copies.append(self.pool.submit(lambda: [b.copy_(cache[i]) for b, i in zip(buffers, self.ids)]))

    def end(self, wait: bool) -> None:
        for copy in self.copies:
            copy.result()
        self.copies.clear()


class SyncCheck:
    """Runs the forward's hooks so that, with a GPU, a call making the host wait for it raises; the
    first such error is kept (`failure`) and the hook runs again unchecked, so the run completes."""

    def __init__(self) -> None:
        self.on = torch.cuda.is_available()
        self.failure: str | None = None

    def run(self, hook: Callable[[], object]):
        if not self.on or self.failure:
            return hook()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return hook()
        except RuntimeError as exc:
            self.failure = str(exc)
            print(f"a hook made the host wait for the GPU: {exc}", flush=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return hook()


def holds(model: Model, ids: torch.Tensor, host: memoryview) -> bool:
    """Whether `host` holds `ids`' blocks of every layer byte for byte, in the host order (a layer's blocks
    after the previous layer's, each block's heads, tokens and content contiguous)."""
    per_layer = len(host) // len(model.caches)
    return all(
        torch.equal(
            cache.index_select(0, ids).contiguous().view(torch.uint8).flatten(),
            kv_mover.host_tensor(host[layer * per_layer : (layer + 1) * per_layer]).to(model.device),
        )
        for layer, cache in model.caches.items()
    )


def compare(
    name: str, timer: Timer, baseline: Callable[[], None], variant: Callable[[], None], repeats: int, per: int = 1
) -> dict:
    """Median times (ms, each call over `per` steps) of `variant` and `baseline`, alternating."""
    baseline(), variant()  # warm up
    base, var = [], []
    for _ in range(repeats):
        base.append(timer(baseline) / per)
        var.append(timer(variant) / per)
    row = {
        "row": name,
        "baseline_ms": [1e3 * t for t in base],
        "with_ms": [1e3 * t for t in var],
        "ratio": statistics.median(var) / statistics.median(base),
    }
    print(
        f"{name:66s} {1e3 * statistics.median(base):9.2f} {1e3 * statistics.median(var):9.2f} {row['ratio']:7.3f}x",
        flush=True,
    )
    return row


def decode_rows(args, model: Model, mover, timer: Timer, pool, registered, check: SyncCheck) -> list[dict]:
    a, device = args, model.device
    batch = a.decode_batch
    keys = torch.randn(batch, a.kv_heads, a.decode_context, a.head_dim, device=device, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    block_of = torch.arange(batch, device=device)  # each request's last block (a slot in it is written)
    slot_of = torch.full((batch,), a.decode_context % a.block_size, device=device)
    x = torch.randn(batch, a.hidden, device=device, dtype=torch.bfloat16)
    written = mover.block_ids(list(range(batch, batch + a.decode_written)))  # blocks that filled: written behind
    layer_bytes = a.decode_written * a.kv_heads * a.block_size * 2 * a.head_dim * 2
    saves = WriteBehind(mover, written, registered.view[: layer_bytes * a.layers], pool, check)
    old = OldWriteBehind(model.caches, written)
    modes = {"eager": None}
    if device.type == "cuda":
        modes = {"piecewise CUDA graphs": Pieces(model, x), "eager": None}

    def steps(hooks, pieces: Pieces | None) -> Callable[[], None]:
        def run() -> None:
            for _ in range(a.steps):
                model.decode(x, (keys, values), (block_of, slot_of), hooks, pieces)
                hooks.end(wait=False)
            hooks.end(wait=True)

        return run

    label = f"decode {batch} x {a.decode_context} tokens, {a.decode_written} blocks written behind"
    rows = []
    for mode, pieces in modes.items():
        rows.append(
            compare(
                f"{label}, {mode} (KvMover)", timer, steps(NoHooks(), pieces), steps(saves, pieces), a.repeats, a.steps
            )
        )
        rows[-1]["exact"] = holds(model, written, saves.target)
        rows.append(
            compare(
                f"{label}, {mode} (before: .cpu() a layer)",
                timer,
                steps(NoHooks(), pieces),
                steps(old, pieces),
                a.repeats,
                a.steps,
            )
        )
    return rows


def prefill_rows(args, model: Model, mover, timer: Timer, pool, registered, check: SyncCheck) -> list[dict]:
    rows = []
    for tokens in args.prefill_tokens:
        blocks = tokens // args.block_size
        ids = list(range(blocks))
        x = torch.randn(tokens, args.hidden, device=model.device, dtype=torch.bfloat16)
        device_ids = mover.block_ids(ids)
        layer_bytes = blocks * args.kv_heads * args.block_size * 2 * args.head_dim * 2
        saves = PrefillSaves(mover, device_ids, registered.view[: layer_bytes * args.layers], pool, check)
        old = OldPrefillSaves(model.caches, ids, pool)

        def step(hooks) -> Callable[[], None]:
            def run() -> None:
                model.prefill(x, device_ids, hooks)
                hooks.end(wait=True)

            return run

        rows.append(
            compare(
                f"prefill {tokens} tokens, every block saved (KvMover)",
                timer,
                step(NoHooks()),
                step(saves),
                args.repeats,
            )
        )
        rows[-1]["exact"] = holds(model, device_ids, saves.target)
        rows.append(
            compare(
                f"prefill {tokens} tokens (before: block by block, pageable)",
                timer,
                step(NoHooks()),
                step(old),
                max(2, args.repeats // 4),
            )
        )
    return rows


def load_rows(args, model: Model, mover, timer: Timer, registered, check: SyncCheck) -> list[dict]:
    blocks = args.load_tokens // args.block_size
    ids = mover.block_ids(list(range(blocks)))
    layer_bytes = blocks * args.kv_heads * args.block_size * 2 * args.head_dim * 2
    sources = {
        "registered shared memory": registered.view[: layer_bytes * args.layers],
        "pinned": memoryview(mover.memory.take(layer_bytes * args.layers)),
        "pageable": memoryview(bytearray(layer_bytes * args.layers)),
    }
    rows = []
    for kind, source in sources.items():
        kv_mover.host_tensor(source).copy_(
            torch.randn(len(source) // 2, dtype=torch.bfloat16, device=model.device).view(torch.uint8).cpu()
        )
        runs = {
            layer: [(range(blocks), source[layer * layer_bytes : (layer + 1) * layer_bytes])] for layer in model.caches
        }

        def load() -> None:
            mover.start_step()
            for layer in model.caches:
                scattered = mover.scatter(layer, ids, runs[layer], 1)  # (a transfer thread's part)
                check.run(lambda: mover.wait(scattered.event))  # the forward's part

        times = [timer(load) for _ in range(args.repeats + 1)][1:]
        ms = statistics.median(times) * 1e3
        rows.append(
            {
                "row": f"load {args.load_tokens} tokens, every layer, from {kind}",
                "ms": [1e3 * t for t in times],
                "median_ms": ms,
                "mib": layer_bytes * args.layers / 2**20,
                "exact": holds(model, ids, source),
            }
        )
        print(f"{rows[-1]['row']:66s} {'':9s} {ms:9.2f} ms ({layer_bytes * args.layers / 2**20:.0f} MiB)", flush=True)
    return rows


def bandwidth_rows(args, device: torch.device, memory, timer: Timer) -> list[dict]:
    size = args.copy_mib * 2**20
    registered = SharedMemory(size, memory)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    hosts = {
        "pinned": pinned,
        "registered shared memory": torch.frombuffer(registered.view, dtype=torch.uint8),
        "pageable": torch.empty(size, dtype=torch.uint8),
    }
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    rows = []
    for kind, host in hosts.items():
        for direction, copy in (
            ("device->host", lambda h=host: h.copy_(on_device, non_blocking=True)),
            ("host->device", lambda h=host: on_device.copy_(h, non_blocking=True)),
        ):
            times = [timer(copy) for _ in range(args.repeats + 1)][1:]
            rate = size / statistics.median(times) / 1e9
            rows.append({"row": f"copy {args.copy_mib} MiB {direction}, {kind}", "gb_per_s": rate})
            print(f"{rows[-1]['row']:66s} {'':9s} {rate:9.1f} GB/s", flush=True)
    by = {r["row"]: r["gb_per_s"] for r in rows}
    for direction in ("device->host", "host->device"):
        ratio = (
            by[f"copy {args.copy_mib} MiB {direction}, registered shared memory"]
            / by[f"copy {args.copy_mib} MiB {direction}, pinned"]
        )
        rows.append({"row": f"registered / pinned, {direction}", "ratio": ratio})
        print(f"{rows[-1]['row']:66s} {'':9s} {'':9s} {ratio:7.3f}x", flush=True)
    del hosts
    registered.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--decode-written", type=int, default=4, help="blocks a layer written behind a step")
    parser.add_argument("--prefill-tokens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--load-tokens", type=int, default=2048)
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10, help="decode steps a timing")
    parser.add_argument("--smoke", action="store_true", help="small shapes, a couple of repeats (CI, any device)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    print(f"{name}, torch {torch.__version__}; {vars(args)}", flush=True)
    memory = kv_mover.HostMemory(device)
    num_blocks = (
        max(max(args.prefill_tokens), args.load_tokens) // args.block_size + args.decode_batch + args.decode_written
    )
    model = Model(args, device, num_blocks)
    mover = kv_mover.KvMover(model.caches, memory)
    timer = Timer(device)
    largest = max(max(args.prefill_tokens), args.load_tokens) * args.kv_heads * 2 * args.head_dim * 2 * args.layers
    registered = SharedMemory(largest, memory)
    pool = concurrent.futures.ThreadPoolExecutor(4)  # the connector's transfer threads
    check = SyncCheck()
    print(f"{'':66s} {'without':>9s} {'with':>9s}", flush=True)
    try:
        rows = decode_rows(args, model, mover, timer, pool, registered, check)
        rows += prefill_rows(args, model, mover, timer, pool, registered, check)
        rows += load_rows(args, model, mover, timer, registered, check)
        rows += bandwidth_rows(args, device, memory, timer)
    finally:
        pool.shutdown(wait=True)
        registered.close()
    result = {
        "device": name,
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": rows,
        "registered_memory": registered.kind,
        "host_waits_in_hooks": "not checked (no GPU)" if not check.on else check.failure or "none",
        "imports_vllm_or_llmesh": any(m.split(".")[0] in ("vllm", "llmesh") for m in sys.modules),
    }
    inexact = [row["row"] for row in rows if row.get("exact") is False]
    result["inexact_rows"] = inexact
    print(f"moved byte for byte: {'no: ' + '; '.join(inexact) if inexact else 'yes, every save and load'}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if inexact:
        sys.exit(1)


if __name__ == "__main__":
    main()
