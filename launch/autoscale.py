"""`ferry up --autoscale`: the planner in the launcher, acting on `ferry worker` child processes.

Scale-out starts workers under fresh ids; scale-in sends one worker SIGTERM and waits: the worker leaves
routing at once, finishes every stream it holds (within its --drain-grace-s) and exits 0. Nothing here
kills a worker that is draining unless it overruns its own grace period by a wide margin.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence

import httpx

from kvstore.connect import redis_client
from kvstore.registry import Registry
from launch.services import Child
from planner.kafka_lag import KafkaLag
from planner.latency import FrontendScraper, registered_frontends
from planner.loop import Planner
from planner.metrics import PlannerMetrics
from schemas.names import RedisKeys
from schemas.ops_settings import PlannerPolicySettings, PlannerPool
from schemas.settings import WorkerSettings
from workers.worker import READY_MARK

log = logging.getLogger("ferry.stack")

# A draining worker that overruns its own grace period by this much is stuck, not busy.
DRAIN_MARGIN_S = 60.0


class State(enum.Enum):
    """Where a worker child is in its life, as the launcher sees it."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"


@dataclasses.dataclass
class Managed:
    """One worker child and its state."""

    child: Child
    state: State
    watcher: asyncio.Task[None] | None = None


class LocalWorkers:
    """The local-process actuator: starts `ferry worker` children and drains them on scale-in."""

    def __init__(
        self,
        spawn: Callable[[str], Awaitable[Child]],
        worker: WorkerSettings,
        ready_timeout_s: float,
        pool: PlannerPool = "all",
    ) -> None:
        self._spawn = spawn
        self.pool = pool  # whose workers it starts and drains: all of the model's, or one pool's
        self.prefix = "worker" if pool == "all" else pool  # a started worker is named `<prefix>-<n>`
        self._grace_s = worker.drain_grace_s
        self._ready_timeout_s = ready_timeout_s
        self.workers: dict[str, Managed] = {}
        self._next = 0
        self.drained: list[tuple[str, int | None]] = []  # (worker, exit code) of every scale-in
        self.crashed: list[tuple[str, int | None]] = []  # workers that exited without being asked

    def adopt(self, children: Sequence[Child]) -> None:
        """Take charge of the workers `ferry up` started (all ready)."""
        for child in children:
            self._watch(child, State.READY)
        self._next = len(children)

    def _watch(self, child: Child, state: State) -> None:
        m = self.workers[child.name] = Managed(child, state)
        m.watcher = asyncio.create_task(self._follow(m), name=f"follow-{child.name}")

    async def _follow(self, m: Managed) -> None:
        """Mark the child ready when it says so; note how it ended."""
        if m.state is State.STARTING:
            with contextlib.suppress(TimeoutError, RuntimeError):
                await m.child.wait_for_line(lambda line: line.startswith(READY_MARK), self._ready_timeout_s)
                if m.state is State.STARTING:
                    m.state = State.READY
        code = await m.child.proc.wait()
        self.workers.pop(m.child.name, None)
        if m.state is State.DRAINING:
            self.drained.append((m.child.name, code))
            level = logging.INFO if code == 0 else logging.ERROR
            log.log(level, "%s drained and exited with code %s", m.child.name, code)
        else:
            self.crashed.append((m.child.name, code))
            log.error("%s exited unexpectedly with code %s; the planner will replace it", m.child.name, code)

    def active(self) -> list[Managed]:
        """Workers starting or serving (not draining)."""
        return [m for m in self.workers.values() if m.state is not State.DRAINING]

    def starting(self, registered: int) -> int:
        """Workers started that have not said they are ready."""
        return sum(m.state is State.STARTING for m in self.workers.values())

    async def scale(self, desired: int) -> None:
        """Start workers up to `desired`, or drain the newest ones down to it."""
        active = self.active()
        for _ in range(desired - len(active)):
            name = f"{self.prefix}-{self._next}"
            self._next += 1
            self._watch(await self._spawn(name), State.STARTING)
            log.info("planner: started %s", name)
        # Newest first: one still starting holds nothing; a ready one drains what it holds.
        by_age = sorted(active, key=lambda m: (m.state is State.READY, -_index(m.child.name)))
        for m in by_age[: max(0, len(active) - desired)]:
            self._drain(m)

    def _drain(self, m: Managed) -> None:
        m.state = State.DRAINING
        log.info("planner: draining %s (SIGTERM; it finishes its streams, then exits)", m.child.name)
        with contextlib.suppress(ProcessLookupError):
            m.child.proc.send_signal(signal.SIGTERM)
        asyncio.get_running_loop().call_later(self._grace_s + DRAIN_MARGIN_S, self._overran, m)

    def _overran(self, m: Managed) -> None:
        if m.child.proc.returncode is None:
            log.error("%s still running %.0fs past its drain grace; killing it", m.child.name, DRAIN_MARGIN_S)
            m.child.kill()

    async def stop_all(self) -> None:
        """Stop every worker (drain), as `ferry up` does on Ctrl-C."""
        children = [m.child for m in self.workers.values()]
        for m in self.workers.values():
            m.state = State.DRAINING
        await asyncio.gather(*(c.stop(self._grace_s + 10) for c in children))
        for m in list(self.workers.values()):
            if m.watcher is not None:
                m.watcher.cancel()


def _index(name: str) -> int:
    return int(name.rsplit("-", 1)[-1])


@dataclasses.dataclass
class LocalPlanner:
    """The planner of `ferry up --autoscale` and what it holds open."""

    planner: Planner
    actuator: LocalWorkers
    metrics_url: str
    _closers: list[Callable[[], object]]

    async def close(self) -> None:
        """Close the planner's clients."""
        await _close_all(self._closers)


async def _close_all(closers: Sequence[Callable[[], object]]) -> None:
    """Call each closer (awaiting those that return a coroutine); one that fails does not stop the rest."""
    for close in closers:
        with contextlib.suppress(Exception):
            result = close()
            if asyncio.iscoroutine(result):
                await result


async def start_planner(
    policy: PlannerPolicySettings,
    worker: WorkerSettings,
    kafka: str,
    redis_url: str,
    actuator: LocalWorkers,
) -> LocalPlanner:
    """Build the planner of a local stack's workers (the actuator's pool): the registry, its frontends'
    /metrics, Kafka lag, local workers."""
    from prometheus_client import start_http_server

    from launch.services import free_port

    redis = redis_client(redis_url)
    http = httpx.AsyncClient()
    lag = KafkaLag(kafka)
    try:
        await lag.start()
    except BaseException:
        # A broker that is not up yet must not leave the clients opened so far behind the error.
        await _close_all([http.aclose, redis.aclose])
        raise
    metrics = PlannerMetrics()
    server, _thread = start_http_server(free_port(), addr="127.0.0.1", registry=metrics.registry)
    model = worker.served_model_name
    registry = Registry(redis, RedisKeys(worker.redis_prefix))
    # Frontends from the registry: one started beside `ferry up` (same Redis and prefix) counts too.
    scraper = FrontendScraper(http, registered_frontends(registry, model), model)
    planner = Planner(policy, model, registry, scraper, lag, actuator, metrics, pool=actuator.pool)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    return LocalPlanner(planner, actuator, url, [lag.close, http.aclose, redis.aclose, server.shutdown])
