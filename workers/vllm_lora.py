"""LoRA adapters loaded into one vLLM engine: names to vLLM's LoRARequests, loaded and unloaded at run time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from workers.engine import EngineDead, EngineError
from workers.lora import adapter_rank


class Adapters:
    """The adapters of one engine, by name.

    Each request carries its adapter's path too, so vLLM reloads an adapter its cache evicted (more
    adapters than slots) instead of failing the request.
    """

    def __init__(self, base_model: str, max_loras: int, max_lora_rank: int) -> None:
        self._base = base_model
        self._max_loras = max_loras
        self._max_rank = max_lora_rank
        self._loaded: dict[str, LoRARequest] = {}
        self._next_id = 1

    def names(self) -> list[str]:
        """Names of the loaded adapters, sorted."""
        return sorted(self._loaded)

    def get(self, name: str) -> LoRARequest | None:
        """The LoRARequest that selects adapter `name`, if it is loaded."""
        return self._loaded.get(name)

    async def load(self, llm: AsyncLLM, name: str, path: str) -> None:
        """Load adapter `name` from directory `path`; loading the same path again is a no-op."""
        if not self._max_loras:
            raise EngineError("lora_not_supported", "LoRA is off on this worker (start it with --max-loras N)")
        if name == self._base:
            raise EngineError("lora_invalid", f"an adapter cannot take the base model's name {name!r}")
        known = self._loaded.get(name)
        if known is not None:
            if known.lora_path == path:
                return
            raise EngineError("lora_exists", f"adapter {name!r} is already loaded from {known.lora_path!r}")
        # Checked here for a clear error; vLLM would otherwise fail later with a less helpful one.
        await asyncio.to_thread(adapter_rank, path, self._max_rank)
        request = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path)
        self._next_id += 1
        try:
            await llm.add_lora(request)
        except EngineDeadError as e:
            raise EngineDead("vLLM engine died") from e
        except Exception as e:
            raise EngineError("lora_invalid", f"vLLM could not load adapter {name!r}: {e}") from e
        self._loaded[name] = request

    async def unload(self, running_llm: Callable[[], AsyncLLM], name: str) -> None:
        """Forget adapter `name`; requests already running with it finish with it."""
        request = self._loaded.pop(name, None)
        if request is None:
            raise EngineError("lora_not_found", f"this worker holds no LoRA adapter {name!r}")
        try:
            await running_llm().remove_lora(request.lora_int_id)
        except EngineDeadError as e:
            raise EngineDead("vLLM engine died") from e
