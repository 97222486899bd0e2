"""The static workers of `ferry up` (no --autoscale) kept running: one that exits unexpectedly is started again.

A worker whose engine died, or that stopped on a fatal error, exits with status 1 for its supervisor to restart
(docs/architecture.md, "Failures"); under `ferry up` that supervisor is this. Its sequences have moved to the
other workers meanwhile, and a new process under the same id is a new worker to the frontends. A worker that
keeps dying soon after it started (a bad flag, an engine that cannot start) is started again ever more slowly,
up to once every MAX_DELAY_S; with --autoscale the planner replaces crashed workers instead (launch/autoscale.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from launch.services import Child

log = logging.getLogger("ferry.up")

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
# A worker that ran this long before it exited gets the first delay again, not the next longer one.
STABLE_S = 60.0
READY_MARK = "ferry-worker-ready"


class WorkerSupervisor:
    """Starts each worker of `workers` again when it exits; the list always holds the current processes."""

    def __init__(
        self,
        workers: list[Child],
        spawn: Callable[[str], Awaitable[Child]],
        ready_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._workers = workers
        self._spawn = spawn
        self._ready_timeout_s = ready_timeout_s
        self._clock = clock
        self._sleep = sleep
        self.restarts = 0

    async def run(self) -> None:
        """Watch every worker until cancelled."""
        await asyncio.gather(*(self._keep(i) for i in range(len(self._workers))))

    async def _keep(self, i: int) -> None:
        delay = FIRST_DELAY_S
        started = self._clock()
        while True:
            child = self._workers[i]
            code = await child.proc.wait()
            if self._clock() - started >= STABLE_S:
                delay = FIRST_DELAY_S
            log.error(
                "%s exited unexpectedly with code %s; starting it again in %.0fs", child.name, code, delay
            )
            await self._sleep(delay)  # a crash loop's pace, not a wait for something
            delay = min(2 * delay, MAX_DELAY_S)
            started = self._clock()
            self._workers[i] = fresh = await self._spawn(child.name)
            self.restarts += 1
            try:
                await fresh.wait_for_line(lambda line: line.startswith(READY_MARK), self._ready_timeout_s)
            except (TimeoutError, RuntimeError) as exc:
                log.error("%s did not come back: %s", child.name, exc)
                fresh.kill()  # (if it still runs) the next round starts it again
                continue
            log.info("%s is back", child.name)
