"""The connector's worker side (each of vLLM's model processes, one a rank): carries out the step's plan
with `llmesh.engine.kv_mover` (the tensors) and a kv-store client (the bytes), without making the forward
wait for the GPU. Per layer, in the forward: `wait_for_layer_load` before its attention (the compute
stream waits for the layer's load), `save_kv_layer` after it (a prefill's blocks of the layer gathered;
a transfer thread copies them into the store's memory and puts them). After the forward,
`wait_for_save` gathers the blocks written behind, every layer at once, then waits for the prefill's
puts."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from llmesh.engine.kv_mover import Gathered, HostMemory, KvMover, Run, Scattered
from llmesh.engine.kvclient import FillGuard, Staged
from llmesh.wire.config import ConnectorConfig

from .metadata import (
    PREFILL_SAMPLE_TOKENS,
    BlockTransfer,
    HeadSlice,
    MeshConnectorMetadata,
    MeshWorkerMetadata,
    layer_index,
    layer_keys,
)

log = logging.getLogger("llmesh.engine.kv_connector")


class Store(Protocol):
    """The kv-store as the worker side uses it (`llmesh.engine.kvclient.ThreadedKvClient`): transfers on its threads."""

    def get(
        self, keys: Sequence[str], consume: Callable[[Any], Any], *, trace_context=None
    ) -> concurrent.futures.Future: ...

    def put_filled(
        self,
        keys: Sequence[str],
        sizes: Sequence[int],
        fill: Callable[[Any], None],
        *,
        pin_s: float,
        trace_context=None,
    ) -> concurrent.futures.Future: ...


class Tracer(Protocol):
    def start_span(self, name: str, *, context: Any = None, attributes: Any = None) -> Any: ...

    def start_as_current_span(self, name: str, *, context: Any = None, start_time: int | None = None) -> Any: ...


@dataclass
class _Planned:
    """A transfer of this step with its block ids on the device (made once, before the forward)."""

    transfer: BlockTransfer
    ids: torch.Tensor


@dataclass
class _PendingLoad:
    """One request's layers being fetched: layer -> the future of its `Scattered`."""

    planned: _Planned
    layers: dict[int, concurrent.futures.Future]
    span: Any
    failed: bool = False
    started: float = field(default_factory=time.perf_counter)
    last_arrival: float = 0.0


class ConnectorWorker:
    """One rank's transfers (see the module's docstring). `slices`: the head groups this rank holds."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        slices: list[HeadSlice],
        block_bytes: int,
        store: Store,
        memory: HostMemory,
        tracer: Tracer,
        trace_context: Callable[[dict[str, str]], Any],
    ):
        self.config = config
        self._slices, self._block_bytes = slices, block_bytes  # block_bytes: one block, every layer (all ranks)
        self._store, self._memory, self._tracer, self._context = store, memory, tracer, trace_context
        self._async_load = config.load_mode == "async"
        self._mover: KvMover | None = None
        self._layers: dict[str, int] = {}  # layer name -> (global) layer number
        self._chunk_bytes = 0  # one block of one layer, one head group
        self._meta: MeshConnectorMetadata | None = None
        # this step's transfers with their block ids; a load's partial last block apart (`start_load_kv`)
        self._step_loads: list[tuple[_Planned | None, _Planned]] = []
        self._saves: list[_Planned] = []  # waited for: gathered layer by layer
        self._written_behind: list[BlockTransfer] = []  # gathered at the step's end
        self._written_behind_ids: torch.Tensor | None = None  # their block ids, one after another
        self._exports: list[_Planned] = []
        self._loads: dict[str, _PendingLoad] = {}
        self._pending_puts: list[tuple[concurrent.futures.Future, FillGuard, str]] = []  # waited for at the step's end
        self._write_behind_puts: list[tuple[concurrent.futures.Future, str]] = []  # reaped when done
        self._load_errors: set[int] = set()
        self._measured = MeshWorkerMetadata()
        self._step_started = 0.0
        self._finished_loads: set[str] = set()
        self._exported: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        heads = sum(s.count for s in self._slices)
        for name, cache in kv_caches.items():
            if cache.dim() < 3 or cache.shape[0] != num_blocks or cache.shape[1] != heads:
                raise RuntimeError(
                    f"{name}: expected [blocks ({num_blocks}), this rank's KV heads ({heads}), ...], "
                    f"got shape {tuple(cache.shape)}"
                )
        self._layers = {name: layer_index(name) for name in sorted(kv_caches, key=layer_index)}
        self._mover = KvMover({self._layers[name]: cache for name, cache in kv_caches.items()}, self._memory)
        some = next(iter(kv_caches.values()))
        self._chunk_bytes = some[0].numel() * some.element_size() // len(self._slices)

    @property
    def mover(self) -> KvMover:
        assert self._mover is not None, "register_kv_caches first"
        return self._mover

    def _keys(self, hashes: Sequence[str], layer: int) -> list[str]:
        return layer_keys(list(hashes), layer, self._slices)

    # ---- a step -------------------------------------------------------------------------------------

    def bind(self, meta: MeshConnectorMetadata) -> None:
        """Before the forward: the step's block ids go to the device, once, before the step's copies."""
        self._meta = meta
        self._step_started = time.perf_counter()
        if self._mover is None:
            return
        self._step_loads = []
        for transfer in meta.loads:
            head = None
            if transfer.last_block_tokens and not self._async_load:
                # The engine writes this step's new tokens into the partial last block before
                # `wait_for_layer_load` runs, so that block must be in place before the forward.
                head = self._planned(
                    BlockTransfer(transfer.req_id, transfer.block_ids[-1:], transfer.hashes[-1:], transfer.trace)
                )
                transfer = BlockTransfer(transfer.req_id, transfer.block_ids[:-1], transfer.hashes[:-1], transfer.trace)
            self._step_loads.append((head, self._planned(transfer)))
        self._saves = [self._planned(t) for t in meta.saves if t.wait]
        self._written_behind = [t for t in meta.saves if not t.wait]
        behind = [b for t in self._written_behind for b in t.block_ids]
        self._written_behind_ids = self.mover.block_ids(behind) if behind else None
        self._exports = [self._planned(t) for t in meta.exports]
        self.mover.start_step()

    def _planned(self, transfer: BlockTransfer) -> _Planned:
        return _Planned(transfer, self.mover.block_ids(transfer.block_ids))

    def start_load_kv(self) -> None:
        for planned in self._exports:
            self._export(planned)
        for head, planned in self._step_loads:
            transfer = planned.transfer
            parent = self._context(transfer.trace)
            span = self._tracer.start_span(
                "kv.load",
                context=parent,
                attributes={
                    "kv.blocks": len(transfer.block_ids) + (head is not None),
                    "kv.layers": len(self._layers),
                    "request.id": transfer.req_id,
                },
            )
            if head is not None:
                self._load_now(head, parent)
            self._loads[transfer.req_id] = self._start_fetch(planned, parent, span)
        self._step_loads, self._exports = [], []

    def _start_fetch(self, planned: _Planned, parent: Any, span: Any) -> _PendingLoad:
        """Ask for every layer of `planned` at once; each is copied in as it arrives, while layers compute."""
        transfer = planned.transfer
        load = _PendingLoad(planned, {}, span)
        if not transfer.block_ids:
            return load
        for layer in self._layers.values():
            ready: concurrent.futures.Future = concurrent.futures.Future()
            fetch = self._store.get(
                self._keys(transfer.hashes, layer), partial(self._copy_in, layer, planned, ready), trace_context=parent
            )
            fetch.add_done_callback(partial(self._fetched, load, ready))
            load.layers[layer] = ready
        return load

    def _copy_in(self, layer: int, planned: _Planned, ready: concurrent.futures.Future, fetched: Any) -> None:
        """A layer's chunks arrived (a transfer thread): copy them into the cache; `ready` is set as soon as
        the copy is under way, the fetched bytes released once it has read them."""
        scattered = self.mover.scatter(layer, planned.ids, self._runs(fetched), len(self._slices))
        ready.set_result(scattered)
        scattered.release()

    @staticmethod
    def _fetched(load: _PendingLoad, ready: concurrent.futures.Future, fetch: concurrent.futures.Future) -> None:
        load.last_arrival = time.perf_counter()
        if not ready.done():  # the fetch or the copy failed
            ready.set_exception(
                concurrent.futures.CancelledError()
                if fetch.cancelled()
                else fetch.exception() or RuntimeError("no copy was made")
            )

    def _runs(self, fetched: Any) -> list[Run]:
        """The fetched runs, less values of the wrong size (each then its own run, or dropped: missing)."""
        runs = []
        for positions, view in fetched.runs:
            if len(view) == len(positions) * self._chunk_bytes:
                runs.append((positions, view))
            else:
                runs += [([i], fetched[i]) for i in positions if len(fetched[i]) == self._chunk_bytes]
        return runs

    def _load_now(self, planned: _Planned, parent: Any) -> None:
        """Load `planned`'s blocks of every layer before the forward."""
        load = self._start_fetch(planned, parent, None)
        for layer in list(load.layers):
            self._finish_layer(load, layer)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._async_load:
            return
        layer = self._layers[layer_name]
        for req_id, load in list(self._loads.items()):
            self._finish_layer(load, layer)
            if not load.layers:
                self._end_load(req_id)

    def _finish_layer(self, load: _PendingLoad, layer: int) -> None:
        """The host waits for the layer's chunks to arrive (not for the GPU); the compute stream for its copy."""
        ready = load.layers.pop(layer, None)
        if ready is None:
            return
        try:
            scattered: Scattered = ready.result(timeout=self.config.timeout_s)
        except Exception as exc:  # the store is down or slow: recompute instead
            log.warning("request %s: loading layer %d failed: %s", load.planned.transfer.req_id, layer, exc)
            missing = load.planned.transfer.block_ids
        else:
            self.mover.wait(scattered.event)
            missing = [load.planned.transfer.block_ids[i] for i in scattered.missing]
        if missing:
            load.failed = True
            self._load_errors.update(missing)

    def _end_load(self, req_id: str) -> None:
        load = self._loads.pop(req_id)
        if not load.failed and load.last_arrival:
            self._measured.load_bytes += len(load.planned.transfer.block_ids) * self._block_bytes
            self._measured.load_s += load.last_arrival - load.started
        load.span.set_attribute("kv.failed", load.failed)
        load.span.end()
        if self._async_load:
            self._finished_loads.add(req_id)

    def _export(self, planned: _Planned) -> None:
        """Copy a stopped request's blocks out and put them (not waited for: its blocks are freed once
        copied; whoever needs them waits for the keys in the store)."""
        transfer = planned.transfer
        for layer in self._layers.values():
            gathered = self.mover.gather(layer, planned.ids, stable=False)
            self._put(transfer, self._keys(transfer.hashes, layer), gathered, pin_s=self.config.pin_s)
        self._exported.add(transfer.req_id)

    def save_kv_layer(self, layer_name: str) -> None:
        """A prefill's blocks of the layer (the step waits for their puts, so they stay as they are)."""
        layer = self._layers[layer_name]
        for planned in self._saves:
            gathered = self.mover.gather(layer, planned.ids, stable=True)
            self._put(planned.transfer, self._keys(planned.transfer.hashes, layer), gathered, pin_s=self.config.pin_s)

    def _write_behind(self) -> None:
        """After the forward: the blocks that filled, every layer, copied out in one gather (before the next
        step may reuse them) and put, a request's with one put, not waited for."""
        if self._written_behind_ids is None:
            return
        gathered, start = self.mover.gather_layers(self._written_behind_ids), 0
        layers = sorted(self._layers.values())  # (gather_layers' order)
        for transfer in self._written_behind:
            count = len(transfer.block_ids)
            keys = [key for layer in layers for key in self._keys(transfer.hashes, layer)]
            self._put(transfer, keys, gathered.blocks(start, count), pin_s=0.0)
            start += count
        self._written_behind, self._written_behind_ids = [], None

    def _put(self, transfer: BlockTransfer, keys: list[str], gathered: Gathered, pin_s: float) -> None:
        """Put gathered blocks under `keys`, in their order (from a transfer thread, into the memory they are
        sent from)."""
        guard = FillGuard()
        future = self._store.put_filled(
            keys,
            [self._chunk_bytes] * len(keys),
            guard.guarded(partial(self._write, gathered)),
            pin_s=pin_s,
            trace_context=self._context(transfer.trace),
        )
        if transfer.wait:
            self._pending_puts.append((future, guard, transfer.req_id))
        else:
            self._write_behind_puts.append((future, transfer.req_id))

    def _write(self, gathered: Gathered, staged: Staged) -> None:
        gathered.write(staged.runs, len(self._slices))

    def wait_for_save(self) -> None:
        """Prefill: the step ends once its KV is stored (decode may load it next). Decode's write-behind
        is not waited for: its blocks are copied out after the forward, in the compute stream's order."""
        if self._mover is not None:
            self._write_behind()
        self._reap_write_behind()
        meta = self._meta
        if meta is not None and not meta.loads and meta.step_tokens >= PREFILL_SAMPLE_TOKENS and self._step_started:
            self._measured.compute_tokens, self._measured.compute_s = (
                meta.step_tokens,
                time.perf_counter() - self._step_started,
            )
        if not self._pending_puts:
            return
        started_ns = time.time_ns()
        for future, guard, req_id in self._pending_puts:
            try:
                future.result(timeout=self.config.timeout_s)
            except Exception as exc:  # the decode side will miss and recompute
                guard.revoke()  # its blocks may be reused once the step ends: a late copy would store those
                log.warning("request %s: saving KV failed: %s", req_id, exc)
        self._pending_puts.clear()
        if meta is not None:
            for transfer in meta.saves:
                with self._tracer.start_as_current_span(
                    "kv.save_wait", context=self._context(transfer.trace), start_time=started_ns
                ) as span:
                    span.set_attribute("kv.blocks", len(transfer.block_ids))

    def _reap_write_behind(self) -> None:
        pending = []
        for future, req_id in self._write_behind_puts:
            if not future.done():
                pending.append((future, req_id))
            elif future.exception() is not None:
                log.warning("request %s: writing KV back failed: %s", req_id, future.exception())
        self._write_behind_puts = pending

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._async_load:
            for req_id, load in list(self._loads.items()):
                for layer, ready in list(load.layers.items()):
                    if ready.done():
                        self._finish_layer(load, layer)
                if not load.layers:
                    self._end_load(req_id)
        done, self._finished_loads = self._finished_loads, set()
        sent, self._exported = self._exported, set()
        return (sent or None), (done or None)

    def build_worker_meta(self) -> MeshWorkerMetadata | None:
        measured, self._measured = self._measured, MeshWorkerMetadata()
        return measured if measured.load_s or measured.compute_s else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
