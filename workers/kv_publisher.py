"""Feeds an engine's KV event batches into the Redis index, in order, through Redis outages."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

from kvstore.kv_index import KVIndex
from schemas.kv_events import KVEventBatch
from workers.metrics import WorkerMetrics

log = logging.getLogger("ferry.worker")


class KVPublisher:
    """Applies batches as they come; while Redis is down they queue (bounded) and go out merged."""

    def __init__(
        self, index: KVIndex, worker_id: str, model: str, metrics: WorkerMetrics, max_backlog: int = 10_000
    ) -> None:
        self._index = index
        self._worker_id = worker_id
        self._model = model
        self._metrics = metrics
        self._max_backlog = max_backlog
        self._backlog: list[KVEventBatch] = []
        # Set when batches were dropped: the index no longer matches the engine, so start over.
        self._must_clear = False
        self._ok = True
        # Also given every batch (the KV log, workers/kv_log.py), unless --no-kv-log.
        self.also: Callable[[KVEventBatch], None] | None = None

    async def run(self, batches: AsyncIterator[KVEventBatch]) -> None:
        """Publish every batch of `batches` until it ends."""
        async for batch in batches:
            if self.also is not None:
                self.also(batch)
            self._backlog.append(batch)
            if len(self._backlog) > self._max_backlog:
                # Losing removals would make the router trust blocks that are gone; losing stores only
                # hides blocks. So drop everything and clear this worker's entries on recovery.
                self._backlog.clear()
                self._must_clear = True
                self._metrics.kv_index_resets.inc()
            await self.flush()

    async def flush(self) -> None:
        """Send whatever is queued, as one round trip; keep it queued if Redis fails."""
        if not self._backlog and not self._must_clear:
            return
        merged = KVEventBatch(time.time(), [e for b in self._backlog for e in b.events])
        try:
            if self._must_clear:
                await self._index.clear_worker(self._worker_id)
                self._must_clear = False
            await self._index.apply(self._worker_id, self._model, merged)
        except Exception as exc:
            self._metrics.kv_publish_errors.inc()
            if self._ok:
                log.warning("KV events not published (%r); queueing up to %d batches", exc, self._max_backlog)
                self._ok = False
            return
        self._metrics.kv_events.inc(len(merged.events))
        self._backlog.clear()
        if not self._ok:
            log.info("KV events published again")
            self._ok = True
