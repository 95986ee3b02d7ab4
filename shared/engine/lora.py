"""The LoRA adapters a worker serves, as vLLM's server keeps them: each a `LoRARequest` under its name, with an
id of this engine's own. Its catalogue entry's `lora_modules` are loaded at start; the router's commands load
and unload more (`LoraCommand`); and a request naming one this engine does not know yet (loaded at run time
through another worker, or this worker restarted since) brings its folder, and the engine loads it then, as
vLLM loads an adapter it has registered but evicted. Heartbeats say which it serves and which its engine holds
loaded now (the router prefers those: llmesh.policies.core.adapter_holders)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from llmesh.wire.errors import InvalidRequest
from llmesh.wire.messages import LoraAdapter

log = logging.getLogger(__name__)


def local_path(path: str, model_dir: Path) -> str:
    """An adapter's folder: a folder's name in `model_dir`, a path, or a hub name's snapshot (vLLM's resolution,
    which downloads it)."""
    from vllm.lora.utils import get_adapter_absolute_path

    under = Path(model_dir) / path
    return str(under) if not Path(path).is_absolute() and under.is_dir() else get_adapter_absolute_path(path)


class Adapters:
    def __init__(self, engine: Any, model_dir: Path, enabled: bool):
        self._engine, self._model_dir, self.enabled = engine, model_dir, enabled
        self._served: dict[str, tuple[str, Any]] = {}  # name -> (its folder as given, vLLM's LoRARequest)
        self._ids = itertools.count(1)
        self.loaded: list[str] = []  # the names its engine holds loaded, as of the last `refresh`

    async def start(self, adapters: Iterable[LoraAdapter]) -> None:
        for adapter in adapters:
            await self.load(adapter)

    def _check(self, adapter: LoraAdapter) -> None:
        if not self.enabled:
            raise InvalidRequest(
                f"LoRA adapters are off for this model (adapter {adapter.name!r}): give it `lora_modules` or "
                'engine_args {"enable_lora": true} in MESH_MODELS',
                param="model",
            )
        given, _ = self._served.get(adapter.name, (adapter.path, None))
        if given != adapter.path:
            raise InvalidRequest(f"the adapter {adapter.name!r} is {given}, not {adapter.path}", param="lora_path")

    def _register(self, adapter: LoraAdapter) -> Any:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(adapter.name, next(self._ids), local_path(adapter.path, self._model_dir))
        self._served[adapter.name] = (adapter.path, request)
        return request

    def request(self, adapter: LoraAdapter | None) -> Any:
        """vLLM's LoRARequest for `adapter` (None: the base model), registered now if this engine had not
        seen it (the engine loads it with the request)."""
        if adapter is None:
            return None
        self._check(adapter)
        if adapter.name in self._served:
            return self._served[adapter.name][1]
        log.info("serving LoRA adapter %s (%s), loaded with its first request", adapter.name, adapter.path)
        return self._register(adapter)

    async def load(self, adapter: LoraAdapter) -> None:
        """Load `adapter` into the engine now (vLLM's checks: its rank, its modules, its folder); an adapter it
        serves already under that name and folder is left as it is."""
        self._check(adapter)
        if adapter.name in self._served:
            return
        request = self._register(adapter)
        try:
            await self._engine.add_lora(request)
        except Exception as exc:  # (vLLM's refusal of this adapter)
            del self._served[adapter.name]
            raise InvalidRequest(f"cannot load the LoRA adapter {adapter.name!r}: {exc}", param="lora_path") from exc
        log.info("loaded LoRA adapter %s (%s)", adapter.name, adapter.path)

    async def unload(self, name: str) -> None:
        _, request = self._served.pop(name, (None, None))
        if request is not None:
            await self._engine.remove_lora(request.lora_int_id)
            log.info("unloaded LoRA adapter %s", name)

    def served(self) -> dict[str, str]:
        """name -> folder (as given) of each adapter it serves."""
        return {name: given for name, (given, _) in self._served.items()}

    async def refresh(self) -> None:
        """Read which of them its engine holds loaded now (vLLM evicts the least recently used past
        max_cpu_loras)."""
        if not self._served:
            self.loaded = []
            return
        ids = await self._engine.list_loras()
        self.loaded = sorted(name for name, (_, request) in self._served.items() if request.lora_int_id in ids)
