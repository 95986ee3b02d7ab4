"""Moves KV blocks between vLLM's paged cache and host memory, one copy a layer, without making the
forward's thread wait for the GPU. Imports only torch (and numpy), so a GPU machine without vLLM runs
it as the connector does (bench/kv_mover.py).

A layer's cache is vLLM's logical view `[blocks, KV heads, tokens, content]`, whatever its physical
stride order (vLLM 0.32: `vllm/v1/kv_cache_interface.py`, `create_kv_cache_views`). On the host, a
layer's blocks are bytes in one canonical order: block after block, each block's heads, tokens and
content contiguous, a block cut into `chunks` equal pieces of whole heads (the kv-store's chunks, in
`MeshKVConnector`'s key order). Host bytes arrive and leave as `Run`s: the chunk positions a contiguous
piece of host memory holds, in order (one run in all when one kv-store shard holds every chunk).

- Save: `gather` (the forward's thread, after a layer's attention) copies the layer's blocks with one
  indexed copy into a contiguous device buffer on the compute stream and records an event (in the
  stream's order it costs the copy's own time; on a side stream it would slow the layers' kernels it
  ran beside, more than that: bench/kv_mover.py, measured on an H200); `gather_layers` does it for every
  layer at once (a step's write-behind, after the forward). `Gathered.write` (a transfer thread) has the
  copy-out stream wait for that event, copies into host runs, one device-to-host copy a run, and
  returns once they hold them: the compute stream never waits for a save.
- Load: `scatter` (a transfer thread, as chunks arrive) copies host runs to the device, one
  host-to-device copy a run, and the layer's blocks into the cache with one indexed copy, on the side
  stream after everything the compute stream was given before the step (`start_step`); `wait` (the
  forward's thread, before the layer's attention) has the compute stream wait for it: the host never
  waits for the GPU.
- Block ids go to the device once a step (`block_ids`), from pinned memory, before the forward.
- A transfer thread waits for the GPU on events that block it (`cudaEventBlockingSync`) rather than
  spin: a spinning waiter takes a core from the thread launching the forward.

On a CPU there are no streams: events are None and copies happen when called. A save of blocks that
stay put until it is stored (`stable`: a prefill's, whose step waits for its puts) is not gathered at
all on a CPU: `write` copies straight from the cache into the host runs, the one copy it needs.

`HostMemory` is what the host side is made of: a pool of pinned buffers, and shared-memory mappings
(the kv-store's arena, a connection's segment) registered with CUDA so that copies into them run at
pinned speed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger("llmesh.engine.kv_mover")

Run = tuple[Sequence[int], memoryview]  # chunk positions, in order, and the host bytes holding them
POOL_MIN_BYTES = 1 << 20  # pinned buffers come in powers of two from here


def address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if len(view) else 0


def is_range(positions: Sequence[int]) -> bool:
    """Whether `positions` are consecutive and rising."""
    return (
        isinstance(positions, range)
        and positions.step == 1
        or all(b == a + 1 for a, b in zip(positions, positions[1:]))
    )


class HostMemory:
    """Host memory a device copies at full speed: pinned buffers from a pool (up to `pool_bytes`, then
    plain ones), and shared-memory mappings registered with CUDA (`cudaHostRegister`), once per mapping;
    copies to and from memory that is neither (a mapping that could not be registered: logged once) go
    through a pinned buffer (`fast`). Without a GPU buffers are plain and registering does nothing.
    Thread-safe (kvclient's `HostBuffers`)."""

    def __init__(self, device: torch.device | str, pool_bytes: int = 1 << 30):
        self.pinned = torch.device(device).type == "cuda"
        self._pool_bytes, self._pooled = pool_bytes, 0
        self._free: dict[int, list[np.ndarray]] = {}  # size class -> idle buffers
        self._owners: dict[int, Any] = {}  # id of a buffer's array -> the pinned tensor backing it
        self._registered: dict[int, int] = {}  # address -> bytes, of mappings registered with CUDA
        self._failed = False
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A buffer of `size` bytes; give it back with `give` once no copy reads or writes it."""
        if not self.pinned:
            return memoryview(bytearray(size))
        size_class = max(POOL_MIN_BYTES, 1 << max(size - 1, 0).bit_length())
        with self._lock:
            idle = self._free.get(size_class)
            if idle:
                return idle.pop().data[:size]
            if self._pooled + size_class > self._pool_bytes:
                return memoryview(bytearray(size))  # not pooled: dropped when its views go
            self._pooled += size_class
        tensor = torch.empty(size_class, dtype=torch.uint8, pin_memory=True)
        array = tensor.numpy()
        with self._lock:
            self._owners[id(array)] = tensor
        return array.data[:size]

    def give(self, view: memoryview) -> None:
        owner = view.obj
        if isinstance(owner, np.ndarray) and id(owner) in self._owners:
            with self._lock:
                self._free.setdefault(len(owner), []).append(owner)

    def register(self, view: memoryview) -> None:
        """Let the device copy to and from `view` (a whole mapping) at pinned speed, until `unregister`."""
        if not self.pinned or not len(view):
            return
        ptr = address(view)
        with self._lock:
            if ptr in self._registered:
                return
            error = torch.cuda.cudart().cudaHostRegister(ptr, len(view), 0)
            if int(error) == 0:
                self._registered[ptr] = len(view)
                return
        if not self._failed:
            self._failed = True
            log.warning(
                "cudaHostRegister of %d bytes of shared memory failed (%s): copies to and from the "
                "kv-store go through pinned buffers",
                len(view),
                error,
            )

    def fast(self, view: memoryview) -> bool:
        """Whether the device copies to and from `view` at pinned speed (always, without a GPU): it lies in
        a registered mapping or in a pooled pinned buffer. Else a copy goes through a pinned buffer."""
        if not self.pinned or isinstance(view.obj, np.ndarray) and id(view.obj) in self._owners:
            return True
        start = address(view)
        return any(ptr <= start and start + len(view) <= ptr + size for ptr, size in list(self._registered.items()))

    def unregister(self, view: memoryview) -> None:
        """Before `view`'s mapping is closed."""
        if not self.pinned or not len(view):
            return
        ptr = address(view)
        with self._lock:
            if self._registered.pop(ptr, None) is not None:
                torch.cuda.cudart().cudaHostUnregister(ptr)


def host_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)


class Gathered:
    """Blocks copied out of the cache for a save (`KvMover.gather`, `gather_layers`): `layers` of `blocks`
    each, layer after layer, written to host runs by `write`."""

    def __init__(self, mover: KvMover, source: torch.Tensor, ids: torch.Tensor | None, done: Any):
        """`source`: [layers, blocks, ...] gathered, or (with `ids`, on a CPU) one layer's cache to take
        `ids` from when written."""
        self._mover, self._source, self._ids, self._done = mover, source, ids, done

    def blocks(self, start: int, count: int) -> Gathered:
        """Blocks `start` to `start + count` of each layer (one request's part of a step's gather)."""
        assert self._ids is None
        return Gathered(self._mover, self._source[:, start : start + count], None, self._done)

    def write(self, runs: Sequence[Run], chunks: int) -> None:
        """Copy the blocks, cut into `chunks` pieces each, into host `runs` (positions counted layer after
        layer, then block, then piece); returns once they hold them. On a transfer thread."""
        mover = self._mover
        if self._ids is not None:
            whole = len(runs) == 1 and list(runs[0][0]) == list(range(len(self._ids) * chunks))
            if whole:  # the blocks are stable and one run takes them all: straight from the cache (CPU)
                out = host_tensor(runs[0][1]).view(self._source.dtype).view(len(self._ids), *self._source.shape[1:])
                torch.index_select(self._source, 0, self._ids, out=out)
                return
            source = self._source.index_select(0, self._ids).unsqueeze(0)
        else:
            source = self._source
        bounced = []  # (run, pinned buffer) for runs the device cannot copy into at full speed
        with mover.on_copy_out():
            if self._done is not None:
                assert mover.copy_out is not None  # an event: on a GPU
                mover.copy_out.wait_event(self._done)
            pieces = source.view(torch.uint8).reshape(source.shape[0] * source.shape[1] * chunks, -1)
            for positions, view in runs:
                if not mover.memory.fast(view):
                    bounced.append((view, mover.memory.take(len(view))))
                    view = bounced[-1][1]
                target = host_tensor(view).view(len(positions), pieces.shape[1])
                part = (
                    pieces[positions[0] : positions[-1] + 1]
                    if is_range(positions)
                    else pieces.index_select(0, mover.to_device(list(positions)))
                )
                target.copy_(part, non_blocking=True)
            mover.synchronize(mover.record(blocking=True))
        for view, pinned in bounced:
            view[:] = pinned
            mover.memory.give(pinned)


def widest(cache: torch.Tensor) -> torch.Tensor:
    """`cache` viewed as 8-byte elements where its strides allow: the same bytes, a quarter of bf16's
    elements for an indexed copy to address (it computes each element's offset)."""
    ratio = 8 // cache.element_size()
    if ratio <= 1 or cache.stride(-1) != 1 or cache.shape[-1] % ratio or cache.storage_offset() % ratio:
        return cache
    if any(stride % ratio for stride in cache.stride()[:-1]):
        return cache
    return cache.view(torch.int64)


def stacked(caches: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
    """Every layer's cache as one view `[layers, blocks, ...]`, in layer order, where they are views of one
    allocation a fixed stride apart (as vLLM 0.32's `allocate_kv_cache` makes them); else None."""
    views = [caches[layer] for layer in sorted(caches)]
    first = views[0]
    same = all(
        v.shape == first.shape
        and v.stride() == first.stride()
        and v.dtype == first.dtype
        and v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        for v in views
    )
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else 0
    if (
        not same
        or step <= 0
        or any(v.storage_offset() != first.storage_offset() + i * step for i, v in enumerate(views))
    ):
        return None
    return torch.as_strided(first, (len(views), *first.shape), (step, *first.stride()), first.storage_offset())


class KvMover:
    """Copies between one engine's per-layer caches and host memory (see the module's docstring)."""

    def __init__(self, caches: Mapping[int, torch.Tensor], memory: HostMemory | None = None):
        """`caches`: each layer's cache by its (global) layer number (copied as bytes: any dtype)."""
        self.caches = {layer: widest(cache) for layer, cache in caches.items()}
        self.stacked = stacked(self.caches)  # every layer at once, where they share one allocation
        self.device = next(iter(self.caches.values())).device
        self.cuda = self.device.type == "cuda"
        self.memory = memory or HostMemory(self.device)
        self.side = torch.cuda.Stream(self.device) if self.cuda else None  # loads
        self.copy_out = torch.cuda.Stream(self.device) if self.cuda else None  # saves' device-to-host copies
        self._step_event: Any = None

    # ---- streams and events (nothing on a CPU) ----------------------------------------------------------

    def on_side(self) -> Any:
        return torch.cuda.stream(self.side) if self.cuda else _NoStream()

    def on_copy_out(self) -> Any:
        return torch.cuda.stream(self.copy_out) if self.cuda else _NoStream()

    def record(self, stream: Any = None, *, blocking: bool = False) -> Any:
        """An event marking what `stream` (this thread's current stream by default) has been given so far;
        `blocking`: a host waiting for it sleeps instead of spinning."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(blocking=blocking)
        event.record(stream or torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        """The compute stream waits for `event` (the host does not)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def synchronize(event: Any) -> None:
        """The host waits for `event`: only on transfer threads, never in a forward."""
        if event is not None:
            event.synchronize()

    def to_device(self, values: list[int]) -> torch.Tensor:
        """A long tensor of `values` on the device, copied from pinned memory without waiting."""
        host = torch.tensor(values, dtype=torch.long)
        return host.pin_memory().to(self.device, non_blocking=True) if self.cuda else host

    # ---- a step ------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Before the forward: loads of this step follow everything the compute stream was given before."""
        self._step_event = self.record()

    def block_ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids on the device, made once a step before the forward (`start_step` after them)."""
        return self.to_device(ids)

    def gather(self, layer: int, ids: torch.Tensor, *, stable: bool) -> Gathered:
        """Copy `ids`' blocks of `layer` out for a save, after the work the compute stream has been given
        (the layer's attention). `stable`: the blocks stay as they are until the save is written."""
        cache = self.caches[layer]
        if stable and not self.cuda:
            return Gathered(self, cache, ids, None)
        return Gathered(self, cache.index_select(0, ids).unsqueeze(0), None, self.record())

    def gather_layers(self, ids: torch.Tensor) -> Gathered:
        """Copy `ids`' blocks of every layer (in layer order) out for a save, after the work the compute
        stream has been given (a step's forward): one indexed copy in all where the layers share one
        allocation, else one a layer into one buffer."""
        if self.stacked is not None:
            return Gathered(self, self.stacked.index_select(1, ids), None, self.record())
        first = next(iter(self.caches.values()))
        out = torch.empty(len(self.caches), len(ids), *first.shape[1:], dtype=first.dtype, device=self.device)
        for i, layer in enumerate(sorted(self.caches)):
            torch.index_select(self.caches[layer], 0, ids, out=out[i])
        return Gathered(self, out, None, self.record())

    def scatter(self, layer: int, ids: torch.Tensor, runs: Sequence[Run], chunks: int) -> Scattered:
        """Copy host `runs` (chunk positions among `len(ids) * chunks`) into `ids`' blocks of `layer`, on
        the side stream; a block with a chunk missing is left alone. On a transfer thread: the runs stay
        valid until the result's `release` (which waits for the copy out of them)."""
        cache = self.caches[layer]
        blocks, block_bytes = len(ids), cache[0].numel() * cache.element_size()
        staging, present, missing = None, None, []
        if len(runs) == 1 and list(runs[0][0]) == list(range(blocks * chunks)) and self.memory.fast(runs[0][1]):
            source = host_tensor(runs[0][1])
        else:  # the runs into one pinned buffer first (several shards, chunks missing, or pageable memory)
            seen = np.zeros(blocks * chunks, dtype=bool)
            for positions, _ in runs:
                seen[list(positions)] = True
            complete = seen.reshape(blocks, chunks).all(axis=1)
            present, missing = np.flatnonzero(complete).tolist(), np.flatnonzero(~complete).tolist()
            if not present:
                return Scattered(self, None, missing, None)
            if not missing:
                present = None
            staging = self.memory.take(blocks * block_bytes)
            source = host_tensor(staging)
            rows = source.view(blocks * chunks, -1)
            for positions, view in runs:
                rows[list(positions)] = host_tensor(view).view(len(positions), -1)
        with self.on_side():
            if self.cuda:
                assert self.side is not None
                if self._step_event is not None:
                    self.side.wait_event(self._step_event)
                ids.record_stream(self.side)
            values = source.to(self.device, non_blocking=True) if self.cuda else source
            values = values.view(cache.dtype).view(blocks, *cache.shape[1:])
            if present is None:  # every block
                cache.index_copy_(0, ids, values)
            else:
                where = self.to_device(present)
                cache.index_copy_(0, ids.index_select(0, where), values.index_select(0, where))
            done = self.record(self.side, blocking=True)
        return Scattered(self, done, missing, staging)


class Scattered:
    """A layer's load under way (`KvMover.scatter`): the event the forward waits for (`KvMover.wait`) and
    the positions (in its block ids) of the blocks left alone for a missing chunk."""

    def __init__(self, mover: KvMover, event: Any, missing: list[int], staging: memoryview | None):
        self.event, self.missing = event, missing
        self._mover, self._staging = mover, staging

    def release(self) -> None:
        """Wait (a transfer thread) until the host bytes have been read: they may be reused after."""
        self._mover.synchronize(self.event)
        if self._staging is not None:
            self._mover.memory.give(self._staging)
            self._staging = None


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
