"""A benchmark engine: vLLM's `AsyncLLM` as `llmesh.engine.worker` drives it, computing nothing, its steps timed
by a simulator profile (`sim/profiles/*.json`, e.g. `h100-llama2-7b`, fitted from Vidur's per-operation GPU
measurements), so the control plane (router, NATS, kv-store, placement) can be measured at GPU speed on a
machine without a GPU. Dynamo's mocker and llm-d's inference simulator are this for their stacks.

A worker started with `MESH_MODELLED_ENGINE=<profile>` runs it behind the real services: the same NATS protocol,
heartbeats, admission, capacity and aborts. What it models, as `sim.engine.SimEngine` does: continuous batching
with chunked prefill, each step sleeping the profile's step time for the batch it holds; KV blocks (a request
waits for room); a prefill's KV written to the real kv-store, `kv_bytes_per_token` (default: the profiled
model's) a token, and a decode's read from it before it joins the batch. Real bytes cross the store; their
content is zeros. Writes follow the prefill's step rather than overlapping it layer by layer, so a modelled
TTFT includes the store's write time.

Its outputs are token ids of ordinary words, never an end of sequence: every request runs to its `max_tokens`
(as `ignore_eos`). Taken but not modelled: logprobs, structured outputs, penalties, stop token ids, LoRA
weights (adapters are listed, not applied), prefix reuse (every prompt is computed). A benchmark tool: it never
stands in for vLLM in the suite's exactness paths.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

from llmesh.wire.kvkeys import (
    adapter_digest,
    block_chunk_keys,
    block_hashes,
    chain_seed,
    fingerprint,
    head_groups,
    kv_bytes_per_token,
    kv_layout,
)

from .__main__ import load_profile
from .engine import EngineProfile, SimEngine, SimRequest
from .gpu_profile import TARGETS

log = logging.getLogger(__name__)
PROFILES = Path(__file__).parent / "profiles"
PROFILE_BLOCK_SIZE = 16  # the block size profiles count their KV blocks in (sim.gpu_profile.BLOCK_SIZE)
FIRST_WORD_ID = 260  # past the tiny tokenizers' special and single-byte tokens: whole words


def profile_path(name: str) -> Path:
    """A profile by name (`sim/profiles/<name>.json`) or path."""
    path = Path(name)
    if path.suffix == ".json":
        return path
    path = PROFILES / f"{name}.json"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
        raise ValueError(f"no engine profile {name!r}: a path to a profile's JSON, or one of {known}")
    return path


def modelled_kv_bytes_per_token(profile: EngineProfile, layout: dict[str, Any], itemsize: int) -> int:
    """The KV bytes of a token of the profiled model (its target's shape), else of the served model."""
    target = TARGETS.get(profile.name)
    return target.model.kv_bytes_per_token if target is not None else kv_bytes_per_token(layout, itemsize)


@dataclass
class _Stream:
    """One engine request: its simulated state and what its caller has been given of it."""

    sim: SimRequest
    queue: asyncio.Queue
    prompt: list[int]
    first_word: int  # where its token sequence starts among the vocabulary's words
    producer: bool  # a prefill whose KV a decode elsewhere reads
    hashes: list[str]  # its prompt's blocks, when its KV goes to the store
    cached: int = 0  # prompt tokens whose KV came from the store
    emitted: int = 0


class ModelledEngine:
    """The parts of `AsyncLLM` a worker uses: `generate`, `abort`, `vllm_config`, `get_tokenizer`, the LoRA
    calls and `shutdown`."""

    def __init__(self, vllm_config: Any, profile: EngineProfile, tokenizer: Any, kv_bytes_per_token: int):
        self.vllm_config = vllm_config
        cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
        blocks = profile.kv_blocks * PROFILE_BLOCK_SIZE // cache.block_size
        self.profile = replace(profile, block_size=cache.block_size, kv_blocks=blocks, max_seqs=scheduler.max_num_seqs)
        cache.num_gpu_blocks = blocks
        self._sim = SimEngine("modelled", self.profile)
        self._tokenizer = tokenizer
        self._words = max(tokenizer.vocab_size - FIRST_WORD_ID, 1)
        self.layout = kv_layout(vllm_config)
        self._fingerprint = fingerprint(self.layout)
        self._chunks_per_block = self.layout["num_layers"] * head_groups(self.layout)
        self._chunk_bytes = kv_bytes_per_token * cache.block_size // self._chunks_per_block
        self._zeros = memoryview(bytearray(self._chunk_bytes))
        self._streams: dict[str, _Stream] = {}
        self._aborted: set[str] = set()
        self._work: asyncio.Event | None = None
        self._stepper: asyncio.Task | None = None
        self._store: Any = None  # llmesh.engine.kvclient.ThreadedKvClient, made on the first transfer
        self._saving: set[asyncio.Task] = set()
        self._loras: dict[int, Any] = {}
        self.steps = 0
        self.timings: TextIO | None = None  # each request's engine time to its first token, when asked

    @classmethod
    def start(cls, args: Any, settings: Any, worker_id: str) -> ModelledEngine:
        """From the worker's vLLM engine arguments (`llmesh.engine.worker.engine_args`) and its settings
        (`modelled_*`): the configuration vLLM would run, with the profile's KV blocks in it."""
        from vllm.tokenizers import cached_tokenizer_from_config
        from vllm.usage.usage_lib import UsageContext

        config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        profile = load_profile(profile_path(settings.modelled_engine))
        per_token = settings.modelled_kv_bytes_per_token
        if per_token is None:
            per_token = modelled_kv_bytes_per_token(profile, kv_layout(config), config.model_config.dtype.itemsize)
        engine = cls(config, profile, cached_tokenizer_from_config(config.model_config), per_token)
        if settings.modelled_timings_dir:
            folder = Path(settings.modelled_timings_dir)
            folder.mkdir(parents=True, exist_ok=True)
            engine.timings = (folder / f"{worker_id}.tsv").open("a", buffering=1)
        log.warning(
            "MODELLED ENGINE (a benchmark tool, no model computed): steps timed by %s, %d KV blocks of %d, %d KV "
            "bytes a token through the kv-store",
            profile.name,
            engine.profile.kv_blocks,
            engine.profile.block_size,
            per_token,
        )
        return engine

    def get_tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(
        self, prompt: dict[str, Any], params: Any, request_id: str, lora_request: Any = None, **_: Any
    ) -> AsyncIterator[Any]:
        """The request's outputs, a delta a step (vLLM's `RequestOutputKind.DELTA`; every output so far when
        the caller asked for cumulative ones)."""
        from vllm.sampling_params import RequestOutputKind

        self._ensure_stepping()
        token_ids = list(prompt["prompt_token_ids"])
        kv = (params.extra_args or {}).get("kv_transfer_params") or {}
        producer = bool(kv.get("do_remote_decode"))
        seed = chain_seed(
            self._fingerprint,
            prompt.get("cache_salt"),
            adapter_digest(lora_request.lora_path) if lora_request else None,
        )
        stores = self._chunk_bytes > 0 and (producer or kv.get("save_prompt"))
        stream = _Stream(
            SimRequest(request_id, time.monotonic(), len(token_ids), 1 if producer else params.max_tokens),
            asyncio.Queue(),
            token_ids,
            zlib.crc32(request_id.encode()) % self._words,
            producer,
            block_hashes(seed, token_ids, self.profile.block_size, partial=True) if stores else [],
        )
        listed = kv.get("block_hashes") or []
        if listed and not kv.get("recompute") and not producer:  # a decode: its prompt's KV comes from the store
            stream.cached = await self._load(listed, len(token_ids) - 1)
            stream.sim.prefilled = stream.sim.cached_tokens = stream.cached
        self._streams[request_id] = stream
        self._sim.waiting.append(stream.sim)
        assert self._work is not None
        self._work.set()
        cumulative = params.output_kind == RequestOutputKind.CUMULATIVE
        given: list[int] = []
        finished = False
        try:
            while not finished:
                out = await stream.queue.get()
                finished = out.finished
                if cumulative:
                    given += out.outputs[0].token_ids
                    out.outputs[0].token_ids = list(given)
                yield out
        finally:
            if not finished:
                self._aborted.add(request_id)
                self._work.set()

    async def abort(self, request_id: str | list[str]) -> None:
        """Stop requests at the next step boundary; each one's last output says "abort"."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            stream = self._streams.get(rid)
            if stream is not None:
                self._aborted.add(rid)
                stream.queue.put_nowait(self._output(stream, [], "abort"))
        if self._work is not None:
            self._work.set()

    def _ensure_stepping(self) -> None:
        if self._stepper is None:
            self._work = asyncio.Event()
            self._stepper = asyncio.create_task(self._step_forever(), name="modelled-engine-steps")

    async def _step_forever(self) -> None:
        assert self._work is not None
        while True:
            self._drop_aborted()
            end = self._sim.start_step(time.monotonic())
            if end is None:
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep(max(0.0, end - time.monotonic()))
            self._sim.finish_step(end)
            self.steps += 1
            self._emit()

    def _drop_aborted(self) -> None:
        for rid in self._aborted:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                for queue in (self._sim.running, self._sim.waiting):
                    if stream.sim in queue:
                        queue.remove(stream.sim)
        self._aborted.clear()

    def _emit(self) -> None:
        """Every request's tokens of the step that ended."""
        for rid, stream in list(self._streams.items()):
            new = stream.sim.generated - stream.emitted
            if new <= 0 or rid in self._aborted:
                continue
            tokens = [
                FIRST_WORD_ID + (stream.first_word + i) % self._words
                for i in range(stream.emitted, stream.sim.generated)
            ]
            stream.emitted = stream.sim.generated
            done = stream.sim.generated >= stream.sim.output_tokens
            if done:
                del self._streams[rid]
            if stream.hashes and stream.emitted == len(tokens):  # its prompt is computed: its KV to the store
                saving = asyncio.create_task(self._save(stream.hashes))
                self._saving.add(saving)
                saving.add_done_callback(functools.partial(self._saved, stream=stream, tokens=tokens, done=done))
                if stream.producer:  # its decode reads it: the first token once it is stored
                    continue
            stream.queue.put_nowait(self._output(stream, tokens, "length" if done else None))

    def _saved(self, task: asyncio.Task, stream: _Stream, tokens: list[int], done: bool) -> None:
        self._saving.discard(task)
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.warning("request %s: storing its KV failed (%s)", stream.sim.request_id, error)
        if stream.producer:
            stream.queue.put_nowait(self._output(stream, tokens, "length" if done else None, stored=error is None))

    def _output(self, stream: _Stream, tokens: list[int], finish: str | None, stored: bool = False) -> Any:
        from vllm.outputs import CompletionOutput, RequestOutput

        if self.timings is not None and tokens and stream.emitted == len(tokens):  # its first token
            self.timings.write(f"{stream.sim.request_id}\t{time.monotonic() - stream.sim.arrival:.6f}\n")

        text = self._tokenizer.decode(tokens) if stream.producer else ""  # (a decode's text is the worker's)
        kv = (
            {
                "fingerprint": self._fingerprint,
                "kv_layout": self.layout,
                "block_size": self.profile.block_size,
                "block_hashes": stream.hashes,
            }
            if stored
            else None
        )
        return RequestOutput(
            stream.sim.request_id,
            None,
            stream.prompt,
            None,
            [CompletionOutput(0, text, tokens, None, None, finish_reason=finish)],
            finished=finish is not None,
            num_cached_tokens=stream.cached,
            kv_transfer_params=kv,
        )

    def _client(self) -> Any:
        if self._store is None:
            from llmesh.engine.kvclient import ThreadedKvClient
            from llmesh.wire.config import ConnectorConfig

            config = ConnectorConfig.from_extra(self.vllm_config.kv_transfer_config.kv_connector_extra_config)
            self._store = ThreadedKvClient(
                config.nats_url,
                f"{config.service_name}-modelled",
                threads=4,
                redis_url=config.redis_url,
                timeout=config.timeout_s,
            )
        return self._store

    async def _save(self, hashes: list[str]) -> None:
        keys = [key for h in hashes for key in block_chunk_keys(h, self.layout)]
        client = await asyncio.to_thread(self._client)
        await asyncio.wrap_future(client.put(keys, [self._zeros] * len(keys), pin_s=30.0))

    async def _load(self, hashes: list[str], loadable: int) -> int:
        """Read the listed blocks' KV; the prompt tokens it covers (those of the blocks found, from the first)."""
        keys = [key for h in hashes for key in block_chunk_keys(h, self.layout)]
        client = await asyncio.to_thread(self._client)
        found = await asyncio.wrap_future(client.get(keys, lambda values: [v is not None for v in values]))
        whole = 0
        while whole < len(hashes) and all(found[whole * self._chunks_per_block : (whole + 1) * self._chunks_per_block]):
            whole += 1
        return min(whole * self.profile.block_size, loadable)

    async def add_lora(self, request: Any) -> bool:
        self._loras[request.lora_int_id] = request
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self._loras.pop(lora_id, None) is not None

    async def list_loras(self) -> set[int]:
        return set(self._loras)

    def shutdown(self) -> None:
        if self.timings is not None:
            self.timings.close()
        if self._stepper is not None:
            self._stepper.cancel()
        if self._store is not None:
            self._store.close()
