"""The connector's worker side on real tensors: a step's saves, loads and exports through a store held in a
dict (a test double of the kv-store client, transfers on its own threads as the real one's), with vLLM's
cache views in both physical layouts; and the forward's hooks never make the host wait for the device."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from opentelemetry import trace
from torch.overrides import TorchFunctionMode

from llmesh.engine.kv_connector import BlockTransfer, ConnectorWorker, MeshConnectorMetadata, rank_slices
from llmesh.engine.kv_mover import HostMemory, KvMover
from llmesh.engine.kvclient import Fetched, Staged
from llmesh.wire import telemetry
from llmesh.wire.config import ConnectorConfig
from llmesh.wire.errors import ServiceUnavailable

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 8, 4, 16, 8
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


SETTINGS = {
    "nats_url": "nats://unused",
    "redis_url": "",
    "service_name": "test",
    "control_subject": None,
    "otlp_endpoint": None,
    "trace_dir": None,
    "load_mode": "layerwise",
    "pin_s": 60.0,
    "timeout_s": 5.0,
    "reuse_prefix": True,
    "write_behind": True,
    "durable_tail": False,
    "preemption": "auto",
    "kv_heads_per_chunk": 0,
}


def config(**overrides) -> ConnectorConfig:
    return ConnectorConfig(**(SETTINGS | overrides))


class MemoryStore:
    """Chunks in a dict; puts and gets on a thread pool, as `ThreadedKvClient`'s (a test double)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.pins: dict[str, float] = {}
        self.failing = False
        self.hold_puts = threading.Event()
        self.hold_puts.set()
        self._pool = concurrent.futures.ThreadPoolExecutor(4)

    def put_filled(self, keys, sizes, fill, *, pin_s, trace_context=None) -> concurrent.futures.Future:
        def put() -> None:
            self.hold_puts.wait()
            buffer = memoryview(bytearray(sum(sizes)))
            staged, pos = Staged([]), 0
            for size in sizes:
                staged.append(buffer[pos : pos + size])
                pos += size
            staged.runs = [(list(range(len(keys))), buffer)]
            fill(staged)
            for key, view in zip(keys, staged):
                self.values[key], self.pins[key] = bytes(view), pin_s

        return self._pool.submit(put)

    def get(self, keys, consume, *, trace_context=None) -> concurrent.futures.Future:
        def get():
            if self.failing:
                raise ServiceUnavailable("the store is away")
            values = [self.values.get(k) for k in keys]
            present = [i for i, v in enumerate(values) if v is not None]
            run = memoryview(bytearray(b"".join(values[i] for i in present)))
            fetched = Fetched(
                [memoryview(v) if v is not None else None for v in values], [], runs=[(present, run)] if present else []
            )
            return consume(fetched)

        return self._pool.submit(get)


def caches(device: str, layout: str, fill: bool) -> dict[str, torch.Tensor]:
    """One engine's per-layer views `[blocks, heads, tokens, content]` over one buffer, physically
    `[L, B, H, N, C]` (HND) or `[L, B, N, H, C]` (NHD, vLLM's default on GPUs), as vLLM 0.32 makes them."""
    shape = (LAYERS, BLOCKS, HEADS, TOKENS, CONTENT) if layout == "HND" else (LAYERS, BLOCKS, TOKENS, HEADS, CONTENT)
    make = torch.randn if fill else torch.zeros
    buffer = make(shape, dtype=torch.bfloat16, device=device)
    views = [buffer[i] if layout == "HND" else buffer[i].permute(0, 2, 1, 3) for i in range(LAYERS)]
    return dict(zip(NAMES, views))


def worker(store: MemoryStore, kv: dict[str, torch.Tensor], per: int = HEADS, **overrides) -> ConnectorWorker:
    slices = rank_slices({"num_kv_heads": HEADS, "kv_heads_per_chunk": per}, 1, 0)
    side = ConnectorWorker(
        config(**overrides),
        slices=slices,
        block_bytes=1,
        store=store,
        memory=HostMemory(next(iter(kv.values())).device),
        tracer=trace.get_tracer("test"),
        trace_context=telemetry.extract,
    )
    side.register_kv_caches(kv, BLOCKS)
    return side


def step(side: ConnectorWorker, meta: MeshConnectorMetadata) -> None:
    """One forward as vLLM's model runner drives the connector."""
    side.bind(meta)
    side.start_load_kv()
    for name in NAMES:
        side.wait_for_layer_load(name)
        side.save_kv_layer(name)
    side.wait_for_save()


def prefill(store: MemoryStore, device: str, layout: str, per: int, ids: list[int], hashes: list[str]):
    kv = caches(device, layout, fill=True)
    step(worker(store, kv, per), MeshConnectorMetadata(saves=[BlockTransfer("p", ids, hashes, wait=True)]))
    return kv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("writer, reader", [("HND", "HND"), ("NHD", "HND"), ("HND", "NHD"), ("NHD", "NHD")])
@pytest.mark.parametrize("per", [HEADS, 1])
def test_what_a_prefill_saves_a_decode_loads_exactly_whatever_the_cache_layouts(device, writer, reader, per):
    store = MemoryStore()
    source = prefill(store, device, writer, per, [1, 3, 4], ["a", "b", "c"])
    assert len(store.values) == 3 * LAYERS * (HEADS // per) and set(store.pins.values()) == {60.0}

    kv = caches(device, reader, fill=False)
    side = worker(store, kv, per)
    # the partial last block ("c", 5 tokens) is loaded before the forward, the others layer by layer
    step(side, MeshConnectorMetadata(loads=[BlockTransfer("d", [5, 0, 2], ["a", "b", "c"], last_block_tokens=5)]))
    assert side.get_block_ids_with_load_errors() == set()
    for name in NAMES:
        assert torch.equal(kv[name][[5, 0, 2]], source[name][[1, 3, 4]])
        assert not kv[name][[1, 3, 4, 6, 7]].any()


def test_a_missing_chunk_is_a_load_error_of_its_block_alone():
    store = MemoryStore()
    source = prefill(store, "cpu", "HND", 1, [1, 3], ["a", "b"])
    del store.values["b:2:3"]  # block "b", layer 2, head group 3
    kv = caches("cpu", "HND", fill=False)
    side = worker(store, kv, 1)
    step(side, MeshConnectorMetadata(loads=[BlockTransfer("d", [6, 7], ["a", "b"])]))
    assert side.get_block_ids_with_load_errors() == {7}
    assert torch.equal(kv[NAMES[2]][6], source[NAMES[2]][1]) and not kv[NAMES[2]][7].any()
    assert torch.equal(kv[NAMES[1]][7], source[NAMES[1]][3])  # its other layers are in


def test_a_store_that_fails_makes_every_block_a_load_error_and_the_step_goes_on():
    store = MemoryStore()
    prefill(store, "cpu", "HND", HEADS, [1, 3], ["a", "b"])
    store.failing = True
    side = worker(store, caches("cpu", "HND", fill=False))
    step(side, MeshConnectorMetadata(loads=[BlockTransfer("d", [6, 7], ["a", "b"], last_block_tokens=3)]))
    assert side.get_block_ids_with_load_errors() == {6, 7}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_blocks_written_behind_are_copied_out_before_the_step_ends(device, layout):
    """A decode's write-behind is not waited for: what it stores is every layer's blocks as the forward
    left them, even when they are rewritten (freed blocks reused) before the puts run; several requests'
    blocks are gathered at once and each request's put under its own keys."""
    store = MemoryStore()
    kv = caches(device, layout, fill=True)
    before = {name: cache.clone() for name, cache in kv.items()}
    side = worker(store, kv, per=1)
    store.hold_puts.clear()
    step(side, MeshConnectorMetadata(saves=[BlockTransfer("d", [2], ["x"]), BlockTransfer("e", [6, 0], ["y", "z"])]))
    for cache in kv.values():
        cache.zero_()
    store.hold_puts.set()
    store._pool.shutdown(wait=True)
    for layer, name in enumerate(NAMES):
        for block, chain in ((2, "x"), (6, "y"), (0, "z")):
            for group in range(HEADS):
                chunk = before[name][block, group].cpu().contiguous().view(torch.uint8).numpy().tobytes()
                assert store.values[f"{chain}:{layer}:{group}"] == chunk
    assert len(store.values) == 3 * LAYERS * HEADS and set(store.pins.values()) == {0.0}


def test_a_stopped_requests_blocks_are_exported_pinned_and_reported_sent():
    store = MemoryStore()
    kv = caches("cpu", "NHD", fill=True)
    side = worker(store, kv)
    step(side, MeshConnectorMetadata(exports=[BlockTransfer("gone", [4, 1], ["t1", "t2"])]))
    assert side.get_finished() == ({"gone"}, None)
    store._pool.shutdown(wait=True)
    assert store.values["t2:1:0"] == kv[NAMES[1]][1].contiguous().view(torch.uint8).numpy().tobytes()
    assert store.pins["t1:0:0"] == 60.0


def test_async_loads_are_reported_once_every_layer_is_in():
    store = MemoryStore()
    source = prefill(store, "cpu", "HND", HEADS, [1], ["a"])
    kv = caches("cpu", "HND", fill=False)
    side = worker(store, kv, load_mode="async")
    side.bind(MeshConnectorMetadata(loads=[BlockTransfer("d", [3], ["a"])]))
    side.start_load_kv()
    store._pool.shutdown(wait=True)
    assert side.get_finished() == (None, {"d"})
    assert all(torch.equal(kv[n][3], source[n][1]) for n in NAMES)


FORBIDDEN = {
    "TensorBase.item",
    "TensorBase.numpy",
    "TensorBase.cpu",
    "TensorBase.tolist",
    "TensorBase.to",
    "_VariableFunctionsClass.tensor",
    "_VariableFunctionsClass.as_tensor",
    "TensorBase.pin_memory",
}


class TorchCalls(TorchFunctionMode):
    """The torch functions this thread calls (modes are per thread: transfer threads are not seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@contextmanager
def forward_hooks_checked(device: str, calls: TorchCalls) -> Iterator[None]:
    """While the forward's hooks run: their torch calls recorded, and on a GPU any call that makes the
    host wait for the device raises (`torch.cuda.set_sync_debug_mode`)."""
    with calls:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("device", DEVICES)
def test_the_forward_hooks_never_make_the_host_wait_for_the_device(device, monkeypatch):
    forward = threading.get_ident()
    host_waits: list[str] = []
    synchronize = KvMover.synchronize
    monkeypatch.setattr(
        KvMover,
        "synchronize",
        staticmethod(
            lambda event: (
                host_waits.append("synchronize") if threading.get_ident() == forward else None,
                synchronize(event),
            )
        ),
    )
    store = MemoryStore()
    prefill(store, device, "NHD", 1, [0, 1, 2], ["a", "b", "c"])
    kv = caches(device, "NHD", fill=False)
    side = worker(store, kv, 1)
    # a decode step: two requests loading layer by layer, one writing a block behind
    meta = MeshConnectorMetadata(
        loads=[BlockTransfer("d1", [3, 4], ["a", "b"]), BlockTransfer("d2", [5], ["c"])],
        saves=[BlockTransfer("d3", [6], ["w"])],
    )
    side.bind(meta)
    side.start_load_kv()
    calls = TorchCalls()
    for name in NAMES:
        with forward_hooks_checked(device, calls):
            side.wait_for_layer_load(name)
            side.save_kv_layer(name)
    with forward_hooks_checked(device, calls):  # (the write-behind's gather, after the forward)
        side.wait_for_save()
    assert side.get_block_ids_with_load_errors() == set()
    assert torch.equal(kv[NAMES[0]][5], caches_equal_source(store, "c", 0, kv[NAMES[0]]))
    assert not FORBIDDEN & set(calls.names), calls.names
    assert host_waits == []
    assert any(name.endswith("index_select") for name in calls.names)  # the write-behind's gather (recorded)


def caches_equal_source(store: MemoryStore, block: str, layer: int, like: torch.Tensor) -> torch.Tensor:
    chunks = [store.values[f"{block}:{layer}:{g}"] for g in range(HEADS)]
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=like.dtype).view(like.shape[1:]).to(like.device)


def test_the_connector_asks_vllm_for_piecewise_cuda_graphs():
    """Its hooks run around every attention layer of every step: a full graph would replay without them
    (vLLM 0.32 then turns FULL_AND_PIECEWISE into PIECEWISE, `VllmConfig.__post_init__`)."""
    from llmesh.engine.kv_connector import MeshKVConnector

    assert MeshKVConnector.requires_piecewise_for_cudagraph(SETTINGS)
