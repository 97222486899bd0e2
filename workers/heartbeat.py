"""A worker's place in the registry: its heartbeats (status with a TTL), leaving, and engine health checks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from bus.reader import Reader
from kvstore.kv_index import KVIndex
from kvstore.registry import Registry
from schemas.settings import WorkerSettings
from schemas.status import HEARTBEAT_MISSES, WorkerStatus
from workers.draft_metrics import DraftMetrics
from workers.engine import Engine
from workers.lora import adapters_of
from workers.metrics import WorkerMetrics

log = logging.getLogger("ferry.worker")


class Heartbeat:
    """Publishes the worker's status every interval; once it left (or failed) it never registers again."""

    def __init__(
        self,
        settings: WorkerSettings,
        engine: Engine,
        engine_name: str,
        registry: Registry,
        index: KVIndex,
        metrics: WorkerMetrics,
        inflight: Callable[[], int],
    ) -> None:
        self._settings = settings
        self._engine = engine
        self._engine_name = engine_name
        self._registry = registry
        self._index = index
        self._metrics = metrics
        self._drafts = DraftMetrics(metrics.registry)
        self._inflight = inflight
        self._started_at = time.time()
        self.metrics_url = ""
        self.draining = False
        self.stopped = False  # left, or failed: no heartbeat may register us again
        self._publishing: asyncio.Future[None] | None = None
        self._redis_ok = True
        # Kafka readers whose consumer lag is recorded with every heartbeat (set by the worker).
        self.readers: list[Reader[Any]] = []
        self._lag: asyncio.Task[None] | None = None

    @property
    def ttl_s(self) -> float:
        """How long the registry keeps this worker without a heartbeat."""
        return self._settings.heartbeat_interval_s * HEARTBEAT_MISSES

    def status(self) -> WorkerStatus:
        """This worker's registry record right now."""
        st = self._engine.stats()
        s = self._settings
        return WorkerStatus(
            worker_id=s.worker_id,
            model=s.served_model_name,
            engine=self._engine_name,
            block_size=st.block_size,
            total_blocks=st.total_blocks,
            max_model_len=st.max_model_len,
            started_at=self._started_at,
            heartbeat_at=time.time(),
            running=st.running,
            waiting=st.waiting,
            kv_usage=st.kv_usage,
            prefix_hit_rate=st.prefix_hit_rate,
            draining=self.draining,
            lora_adapters=adapters_of(self._engine),
            metrics_url=self.metrics_url,
            heartbeat_interval_s=s.heartbeat_interval_s,
            role=s.role,
            max_num_seqs=s.max_num_seqs,
        )

    @property
    def started_at(self) -> float:
        """When this process started (its registry status says so; the KV log names its incarnation by it)."""
        return self._started_at

    async def once(self) -> None:
        """Publish the status now (raises if Redis is unreachable)."""
        if self.stopped:
            return  # a heartbeat now would register a worker that can no longer serve
        status = self.status()
        stats = self._engine.stats()
        self._metrics.observe(stats, self._inflight())
        self._drafts.observe(stats)
        # Kept so leave() can wait for it: a publish still in flight would re-register us after we left.
        self._publishing = asyncio.ensure_future(self._registry.publish(status, self.ttl_s))
        await asyncio.shield(self._publishing)
        # Off the heartbeat's path: reading positions can wait on a partition being reset.
        if self._lag is None or self._lag.done():
            self._lag = asyncio.create_task(self._record_lag(), name="consumer-lag")

    async def _record_lag(self) -> None:
        for reader in self.readers:
            await self._metrics.record_lag(reader)

    async def run(self) -> None:
        """Heartbeat every interval, forever; Redis outages are logged once and retried."""
        interval = self._settings.heartbeat_interval_s
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(interval)  # the heartbeat period itself, not a wait for an event
            late = time.monotonic() - slept_from - interval
            if late > interval:
                # The one sign, in the worker's own log, of why routers may have dropped it: its event loop
                # was held (a blocking call) or starved of CPU, and the registry's TTL counts on neither.
                log.warning("heartbeat %.1fs late: the event loop was blocked or starved of CPU (the registry "
                            "drops this worker after %.1fs without one)", late, self.ttl_s)  # fmt: skip
            try:
                await self.once()
                if not self._redis_ok:
                    log.info("Redis is reachable again; heartbeats resumed")
                    self._redis_ok = True
            except Exception as exc:
                self._metrics.heartbeat_errors.inc()
                if self._redis_ok:
                    log.warning("heartbeat failed (%r); retrying every %.1fs", exc, interval)
                    self._redis_ok = False

    async def check_health(self) -> None:
        """Ask the engine whether it can still serve, every interval; raises once it cannot."""
        while True:
            await asyncio.sleep(self._settings.heartbeat_interval_s)  # check period
            await self._engine.check_health()

    async def leave(self) -> None:
        """Leave the registry and clear this worker's KV index entries (shielded; the TTL is the fallback)."""
        self.stopped = True
        if self._lag is not None:
            self._lag.cancel()
        if self._publishing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._publishing)
        wid = self._settings.worker_id
        try:
            await asyncio.shield(self._registry.remove(wid))
            await asyncio.shield(self._index.clear_worker(wid))
        except Exception as exc:  # the TTL removes us anyway
            log.warning("could not leave the registry (%r); it expires in %.1fs", exc, self.ttl_s)
