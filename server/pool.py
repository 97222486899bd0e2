"""The frontend's view of live workers, refreshed from the Redis registry in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from kvstore.registry import Registry
from schemas.status import HEARTBEAT_MISSES, WorkerStatus
from server.metrics import FrontendMetrics

log = logging.getLogger("ferry.frontend")

# How long stop() waits for the cancelled refresh: each Redis command in it times out within 2 s.
STOP_WAIT_S = 3.0


def _awaiting(coro: object) -> str:
    """The chain of awaits a suspended coroutine is in, outermost first (a task's own stack shows one frame)."""
    lines = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return "\n".join(lines)


class WorkerPool:
    """Live workers by model; the router reads it without a Redis round trip per request."""

    def __init__(
        self,
        registry: Registry,
        refresh_s: float,
        metrics: FrontendMetrics,
        on_dead: Callable[[str, bool], None],
        after_refresh: Callable[[], Awaitable[None]] | None = None,
        max_waiters: int = 256,
        heartbeat_s: float = 1.0,
    ) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._heartbeat_s = heartbeat_s  # for workers that do not say their own interval
        self._keep_until = 0.0
        self._marker: str | None = None  # the registry marker of the last read
        self._metrics = metrics
        self._on_dead = on_dead
        self.workers: dict[str, WorkerStatus] = {}
        self.redis_ok = True
        self._changed = asyncio.Event()
        self._refreshed = asyncio.Event()
        self._after_refresh = after_refresh
        self._max_waiters = max_waiters
        self._waiters = 0
        self._task: asyncio.Task[None] | None = None
        # Workers that said they stop (`depart`), by the start time of the process that said it: the registry
        # may list them a while yet, and a new process under the same id is another worker.
        self._departed: dict[str, float] = {}

    @property
    def registry(self) -> Registry:
        """The registry this view reads (frontends' announcements are there too)."""
        return self._registry

    async def start(self) -> None:
        """Load the registry once, then keep refreshing it."""
        try:
            await self.refresh()
        except Exception as exc:
            self._mark_down(exc)
        self._task = asyncio.create_task(self._loop(), name="worker-pool")

    async def stop(self) -> None:
        """Stop refreshing; a refresh that does not end once cancelled is logged with where it waits, and left."""
        task = self._task
        if task is None:
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=STOP_WAIT_S)
        if not done:
            # Seen once in a test run: the frontend's exit waited on it until it was killed. Where it waits says why.
            log.warning("the registry refresh did not end %.1fs after its cancel; left behind, waiting in:\n%s",
                        STOP_WAIT_S, _awaiting(task.get_coro()))  # fmt: skip
            return
        await asyncio.gather(task, return_exceptions=True)

    def live(self, model: str) -> list[WorkerStatus]:
        """Workers that take new requests for `model`: a base model, or a LoRA adapter they hold."""
        return [
            w
            for w in self.workers.values()
            if not w.draining and (w.model == model or model in w.lora_adapters)
        ]

    def adapters(self) -> dict[str, tuple[str, int]]:
        """LoRA adapters of live workers: name -> (base model, smallest context length among them)."""
        out: dict[str, tuple[str, int]] = {}
        for w in self.workers.values():
            if w.draining:
                continue
            for name in w.lora_adapters:
                _, known = out.get(name, (w.model, w.max_model_len))
                out[name] = (w.model, min(known, w.max_model_len))
        return out

    def models(self) -> dict[str, int]:
        """Served models and the smallest context length among their workers."""
        out: dict[str, int] = {}
        for w in self.workers.values():
            out[w.model] = min(out.get(w.model, w.max_model_len), w.max_model_len)
        return out

    async def wait_changed(self) -> None:
        """Wait for the next refresh that changed the set of workers."""
        self._changed.clear()
        await self._changed.wait()

    def try_enter_wait(self) -> bool:
        """Take a place in the bounded queue of requests waiting for a non-busy worker."""
        if self._waiters >= self._max_waiters:
            return False
        self._waiters += 1
        self._metrics.queue_depth.set(self._waiters)
        return True

    def leave_wait(self) -> None:
        """Give the place back."""
        self._waiters -= 1
        self._metrics.queue_depth.set(self._waiters)

    async def wait_refreshed(self, timeout_s: float) -> None:
        """Wait for the next registry refresh (fresh load and busy flags), at most `timeout_s`."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._refreshed.wait()
        except TimeoutError:
            pass

    async def refresh(self) -> None:
        """Read the registry now (and exchange router load with other frontends)."""
        t0 = time.perf_counter()
        view = await self._registry.view()
        self._metrics.redis_seconds.labels("registry").observe(time.perf_counter() - t0)
        listed = {w.worker_id: w for w in view.live}
        self._departed = {wid: t for wid, t in self._departed.items() if wid in listed or wid in view.dead}
        new = {wid: w for wid, w in listed.items() if self._departed.get(wid) != w.started_at}
        lost_data, self._marker = self._marker is not None and view.marker != self._marker, view.marker
        if lost_data and self.workers:
            # Kept for one registry TTL: time for every live worker's next heartbeat to register it again.
            keep_s = HEARTBEAT_MISSES * max(w.heartbeat_interval_s or self._heartbeat_s for w in self.workers.values())
            log.warning(
                "Redis lost its data (restarted empty?): keeping the last known %d worker(s) for %.1fs "
                "while their heartbeats register them again", len(self.workers), keep_s,
            )  # fmt: skip
            self._keep_until = time.monotonic() + keep_s
        if time.monotonic() < self._keep_until:
            # Not yet registered again is not dead: nothing they run is lost, nothing needs to move.
            new = {wid: w for wid, w in self.workers.items() if wid not in view.dead} | new
        gone = (set(self.workers) - set(new)) | (set(view.dead) - set(self._departed))
        added = set(new) - set(self.workers)
        # A worker killed and started again under its id within the heartbeat TTL never leaves the
        # registry, but the process that held its sequences is gone: a new start time says so.
        restarted = {
            wid for wid, w in new.items()
            if wid in self.workers and wid not in gone and w.started_at != self.workers[wid].started_at
        }  # fmt: skip
        self.workers = new
        for wid in added:
            log.info("worker %s joined (model %s, engine %s)", wid, new[wid].model, new[wid].engine)
        for wid in gone:
            # An expired status: the worker died, or its heartbeats stopped coming (its own log says why).
            why = ": no heartbeat within its TTL" if wid in view.dead else ""
            log.warning("worker %s left the registry%s", wid, why)
            self._on_dead(wid, False)
        for wid in restarted:
            log.warning("worker %s restarted: what it was running is lost", wid)
            self._on_dead(wid, True)
        self._metrics.live_workers.set(len(new))
        if added or gone:
            self._changed.set()
        if self._after_refresh is not None:
            await self._after_refresh()
        # Wake everyone waiting for a refresh, then re-arm for the next one.
        self._refreshed.set()
        self._refreshed.clear()

    def depart(self, worker_id: str, why: str) -> None:
        """A worker said it stops (`why`): out of routing now, as if it had left the registry."""
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        self._departed[worker_id] = worker.started_at
        log.warning("worker %s left routing: %s", worker_id, why)
        self._metrics.live_workers.set(len(self.workers))
        self._changed.set()
        self._on_dead(worker_id, False)

    def _mark_down(self, exc: BaseException) -> None:
        self._metrics.redis_errors.inc()
        if self.redis_ok:
            log.error("Redis unreachable (%r): keeping the last known %d worker(s)", exc, len(self.workers))
            self.redis_ok = False
            self._metrics.redis_up.set(0)

    async def tick(self) -> bool:
        """One refresh that never raises: notes Redis going away and coming back; True if it worked."""
        try:
            await self.refresh()
        except Exception as exc:
            self._mark_down(exc)
            return False
        if not self.redis_ok:
            log.info("Redis reachable again")
            self.redis_ok = True
            self._metrics.redis_up.set(1)
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)  # the refresh period
            await self.tick()
