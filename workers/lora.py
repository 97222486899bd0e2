"""LoRA adapters on a worker: checks on an adapter directory and the handling of LoadLora/UnloadLora.

An engine that can serve adapters implements `LoraEngine`; any other (the simulated one) answers
every control message with `lora_not_supported`. A request selects an adapter by naming it as its
model, as with vLLM's OpenAI server; `adapter_of` turns that into the adapter name.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

from schemas.kafka import EngineControl, ErrorInfo, GenerateRequest, LoadLora, LoraAck, UnloadLora
from workers.engine import EngineError

log = logging.getLogger("ferry.worker")


@runtime_checkable
class LoraEngine(Protocol):
    """What an engine offers to serve LoRA adapters."""

    def lora_adapters(self) -> list[str]:
        """Names of the adapters requests may use now."""
        ...

    async def load_lora(self, name: str, path: str) -> None:
        """Make adapter `name` from directory `path` available; raises EngineError."""

    async def unload_lora(self, name: str) -> None:
        """Forget adapter `name`; raises EngineError if it is not loaded."""


def adapter_of(request: GenerateRequest, base_model: str) -> str | None:
    """The adapter a request asks for: its `lora_name`, or its model when that names an adapter."""
    if request.lora_name:
        return request.lora_name
    return request.model if request.model != base_model else None


def adapter_rank(path: str, max_rank: int) -> int:
    """The rank of the PEFT LoRA adapter in directory `path`; EngineError `lora_invalid` if unusable."""
    directory = Path(path)
    if not directory.is_absolute():
        raise EngineError("lora_invalid", f"the adapter path {path!r} is not absolute")
    config_file = directory / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise EngineError("lora_invalid", f"no adapter_config.json in {path!r} on this worker") from None
    except (OSError, ValueError) as e:
        raise EngineError("lora_invalid", f"cannot read {config_file}: {e}") from e
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise EngineError("lora_invalid", f"{config_file} does not describe a LoRA adapter")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise EngineError("lora_invalid", f"{config_file} has no valid rank `r`")
    if rank > max_rank:
        raise EngineError(
            "lora_invalid", f"the adapter has rank {rank}; this worker accepts up to {max_rank} (--max-lora-rank)"
        )
    if not any((directory / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise EngineError("lora_invalid", f"no adapter_model.safetensors or adapter_model.bin in {path!r}")
    return rank


def adapters_of(engine: object) -> list[str]:
    """The adapters `engine` serves (none if it cannot serve adapters)."""
    return engine.lora_adapters() if isinstance(engine, LoraEngine) else []


async def apply(engine: object, msg: LoadLora | UnloadLora, worker_id: str) -> LoraAck:
    """Carry out one control message on `engine` and say how it went."""
    error: ErrorInfo | None = None
    try:
        if not isinstance(engine, LoraEngine):
            raise EngineError("lora_not_supported", "this worker's engine cannot serve LoRA adapters")
        if isinstance(msg, LoadLora):
            await engine.load_lora(msg.lora_name, msg.lora_path)
            log.info("LoRA adapter %s loaded from %s", msg.lora_name, msg.lora_path)
        else:
            await engine.unload_lora(msg.lora_name)
            log.info("LoRA adapter %s unloaded", msg.lora_name)
    except EngineError as e:
        error = ErrorInfo(e.code, str(e), e.retriable)
    except Exception as e:
        log.exception("LoRA operation on %s failed", msg.lora_name)
        error = ErrorInfo("engine_error", f"{type(e).__name__}: {e}", retriable=True)
    return LoraAck(msg.op_id, worker_id, msg.lora_name, error, adapters_of(engine))


class LoraControl:
    """Runs control messages off the inbox loop, one at a time, and owns the tasks doing it."""

    def __init__(
        self,
        engine: object,
        worker_id: str,
        published: Callable[[], Awaitable[None]],
        reply: Callable[[str, LoraAck], Awaitable[None]],
    ) -> None:
        self._engine = engine
        self._worker_id = worker_id
        # Publishes the worker's status, so the registry lists the change before the ack arrives.
        self._published = published
        self._reply = reply
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        # Sleep, wake-up and cache reset (workers/engine_control.py), run in turn with adapter changes.
        self.engine_ops: Callable[[EngineControl], Awaitable[LoraAck]] | None = None

    def submit(self, msg: LoadLora | UnloadLora | EngineControl) -> None:
        """Handle `msg` in the background: loading takes a while and must not stall the inbox."""
        task = asyncio.create_task(self._run(msg), name=f"lora-{msg.op_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: LoadLora | UnloadLora | EngineControl) -> None:
        try:
            async with self._lock:
                if isinstance(msg, EngineControl):
                    if self.engine_ops is None:
                        return
                    ack = await self.engine_ops(msg)
                else:
                    ack = await apply(self._engine, msg, self._worker_id)
                try:
                    await self._published()
                except Exception as e:  # the next heartbeat carries it anyway
                    log.warning("could not publish the status after a LoRA change: %r", e)
            await self._reply(msg.reply_topic, ack)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("LoRA control message %s failed", msg.op_id)

    async def close(self) -> None:
        """Cancel whatever is still running."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
