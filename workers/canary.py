"""Canary health checks, as Dynamo's: a tiny real generation proves the engine still produces tokens.

vLLM's check_health only asks whether its EngineCore process is alive; an engine stuck in a step (a hung
kernel, a deadlock) passes it forever. Every `canary_wait_s` the worker sends a one-token generation
when it is idle, or when it is busy but generated nothing over the whole wait. No token within
`canary_timeout_s` is fatal: the worker leaves routing and clears its KV index entries, then drops its
requests without a last word, so that frontends take them for lost and move their streams to other workers
(an error chunk would reach the client instead), and exits non-zero, for its supervisor to restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable

from schemas.kafka import GenerateRequest, SamplingParams
from workers.engine import Engine, EngineDead, EngineError

log = logging.getLogger("ferry.worker")

# Before every real request (lower runs first), so a busy engine answers it in its next step.
CANARY_PRIORITY = -(1 << 30)


class CanaryFailed(EngineDead):
    """The engine produced nothing for a canary in time: it is hung, though it may pass health checks."""


class Canary:
    """Runs the canary generations of one worker; `run()` raises EngineDead when one produces nothing."""

    def __init__(
        self,
        engine: Engine,
        model: str,
        worker_id: str,
        idle: asyncio.Event,
        progress: Callable[[], float],
        wait_s: float,
        timeout_s: float,
    ) -> None:
        self._engine = engine
        self._model = model
        self._worker_id = worker_id
        self._idle = idle
        self._progress = progress
        self.wait_s = wait_s
        self.timeout_s = timeout_s
        self._ids = itertools.count()
        self.sent = 0
        # True while the worker sleeps on purpose (workers/engine_control.py): no canary then.
        self.paused: Callable[[], bool] = lambda: False
        self.last_seconds = 0.0

    async def run(self) -> None:
        """Probe every `wait_s` while the worker is idle or stalled; forever, or until a probe fails."""
        seen = self._progress()
        while True:
            await asyncio.sleep(self.wait_s)  # the canary period itself
            now = self._progress()
            if not self.paused() and (self._idle.is_set() or now == seen):
                await self.probe()
            seen = self._progress()

    async def probe(self) -> None:
        """One tiny generation; EngineDead if it yields nothing within the deadline."""
        request = GenerateRequest(
            request_id=f"canary-{self._worker_id}-{next(self._ids)}",
            model=self._model,
            prompt_token_ids=[0],
            max_tokens=1,
            reply_topic="",
            sampling=SamplingParams(temperature=0.0),
            priority=CANARY_PRIORITY,
        )
        self.sent += 1
        t0 = time.monotonic()
        try:
            stream = self._engine.generate(request)
        except EngineDead:
            raise
        except EngineError as e:  # refused (a full queue), not hung: the next period tries again
            log.warning("canary request refused: %s", e)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                async for out in stream:
                    if out.token_ids or out.finish_reason is not None:
                        break
        except TimeoutError:
            raise CanaryFailed(f"canary: the engine produced nothing within {self.timeout_s:g}s") from None
        except EngineDead:
            raise
        except EngineError as e:  # refused (a full queue), not hung: the next period tries again
            log.warning("canary request refused: %s", e)
        finally:
            # Closing aborts the request; an engine that hangs must not hold the worker here as well.
            close = getattr(stream, "aclose", None)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    if close is not None:
                        await close()
        self.last_seconds = time.monotonic() - t0
        log.debug("canary answered in %.3fs", self.last_seconds)
