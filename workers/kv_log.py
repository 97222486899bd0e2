"""A worker's KV log: its KV events, and a snapshot of its whole cache, on its model's rolled Kafka topic.

The Redis index stays the fast path (workers/kv_publisher.py); this log is what frontends rebuild the index
from when Redis comes back empty (server/kv_indexer.py). Records go out at most every `FLUSH_S`, each with
the events since the previous one, so the topic holds a few records a second per worker however fast the
engine steps. The topic rolls with the wall clock (`--kv-log-roll-s`); the first record a worker writes in
each epoch is a snapshot of every block it holds, so a reader of the current epoch and the one before has
each worker's whole state, and the older epochs can be deleted. A send that fails makes the next record a
snapshot too: whatever went missing is replaced, never patched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from aiokafka import AIOKafkaProducer

from bus.produce import send_and_wait
from bus.topics import ensure_topics, retention
from kvstore.kv_mirror import WorkerBlocks
from schemas.kv_events import MEDIUM_HOST, BlockStored, KVEvent, KVEventBatch, KVLogRecord
from schemas.names import kv_log_topic
from workers.metrics import WorkerMetrics

log = logging.getLogger("ferry.worker")

# Longest an event waits before it goes out: the log is the slow path, Redis is written at once.
FLUSH_S = 0.1
RETRY_S = 1.0  # between tries while the broker refuses
# Hashes per record (9 bytes each in MessagePack): a larger cache's snapshot goes on in records of stored
# blocks, under Kafka's default 1 MB message limit.
SNAPSHOT_MAX = 50_000
_encoder = msgspec.msgpack.Encoder()


def kv_log_retention(roll_s: float, max_bytes: int) -> dict[str, str]:
    """Topic configs of a KV log epoch: Kafka may delete it once nobody reads it (two epochs later)."""
    return retention(3 * roll_s, max_bytes)


class KVLog:
    """Keeps this worker's blocks from its events and writes them to the KV log (see the module docstring)."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        bootstrap: str,
        worker_id: str,
        model: str,
        incarnation: float,
        roll_s: float,
        metrics: WorkerMetrics,
        retention_bytes: int = -1,
        clock: Callable[[], float] = time.time,
        ring: Callable[[], None] | None = None,
    ) -> None:
        self._producer = producer
        self._bootstrap = bootstrap
        self._worker_id = worker_id
        self._model = model
        self._roll_s = roll_s
        self._metrics = metrics
        self._retention_bytes = retention_bytes
        self._clock = clock
        # Rings the frontends' KV log readers once records are in: they sleep between them (server/kv_indexer.py).
        self._ring = ring
        self.own = WorkerBlocks(incarnation)
        self._pending: list[KVEvent] = []
        self._epoch: int | None = None  # the epoch of the last record written; None: the next is a snapshot
        self._created: int | None = None  # the last epoch whose topics were created
        self._wake = asyncio.Event()
        self._ok = True

    def add(self, batch: KVEventBatch) -> None:
        """Take one engine step's events (after the Redis index got them)."""
        self.own.apply(batch.events)
        self._pending.extend(batch.events)
        self._wake.set()

    async def run(self) -> None:
        """Write records until cancelled: events at most every FLUSH_S, a snapshot first in every epoch."""
        while True:
            await self.flush()
            await asyncio.sleep(FLUSH_S if self._ok else RETRY_S)
            if self._epoch == self._epoch_now() and not self._pending:
                # Idle: wait for events, or for the next epoch, which opens with a snapshot even so.
                self._wake.clear()
                left = (self._epoch_now() + 1) * self._roll_s - self._clock()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(left, 0.0)):
                        await self._wake.wait()

    def _records(self, snapshot: bool, events: list[KVEvent]) -> list[KVLogRecord]:
        """The records to write now: `events`, or a snapshot (its tail as stored blocks)."""
        own, now = self.own, self._clock()
        if not snapshot:
            own.seq += 1
            return [KVLogRecord(self._worker_id, own.incarnation, own.seq, now, events=events)]
        device, host = sorted(own.device), sorted(own.host)
        own.seq += 1
        out = [
            KVLogRecord(
                self._worker_id, own.incarnation, own.seq, now, snapshot=True,
                device=device[:SNAPSHOT_MAX], host=host[: max(SNAPSHOT_MAX - len(device), 0)],
            )
        ]  # fmt: skip
        rest: list[KVEvent] = []
        if len(device) > SNAPSHOT_MAX:
            rest += [
                BlockStored(device[i : i + SNAPSHOT_MAX])
                for i in range(SNAPSHOT_MAX, len(device), SNAPSHOT_MAX)
            ]
        skip = max(SNAPSHOT_MAX - len(device), 0)
        rest += [
            BlockStored(host[i : i + SNAPSHOT_MAX], medium=MEDIUM_HOST)
            for i in range(skip, len(host), SNAPSHOT_MAX)
        ]
        for ev in rest:
            own.seq += 1
            out.append(KVLogRecord(self._worker_id, own.incarnation, own.seq, now, events=[ev]))
        return out

    def _epoch_now(self) -> int:
        return int(self._clock() // self._roll_s)

    async def flush(self) -> None:
        """Write what is pending now (a snapshot when the epoch turned or a send failed); never raises."""
        epoch = self._epoch_now()
        snapshot = self._epoch != epoch
        if not snapshot and not self._pending:
            return
        try:
            if self._created != epoch:
                # This epoch's topic and the next, so a reader can be positioned on both before anyone writes.
                topics = {kv_log_topic(self._model, e): 1 for e in (epoch, epoch + 1)}
                await ensure_topics(
                    self._bootstrap, topics, kv_log_retention(self._roll_s, self._retention_bytes)
                )
                self._created = epoch
            topic, key = kv_log_topic(self._model, epoch), self._worker_id.encode()
            # Taken before the sends: events added while they wait go in the next record (a snapshot is built
            # from `own`, which already holds the events taken with it).
            records = self._records(snapshot, self._pending)
            self._pending = []
            for rec in records:
                await send_and_wait(self._producer, topic, _encoder.encode(rec), key)
                self._metrics.kv_log_records.labels("snapshot" if rec.snapshot else "events").inc()
        except Exception as exc:
            self._epoch = None  # what may be lost is replaced by the next record, a snapshot
            self._metrics.kv_log_errors.inc()
            if self._ok:
                log.warning("KV log not written (%r); a snapshot follows once it works", exc)
                self._ok = False
            return
        self._epoch = epoch
        if self._ring is not None:
            self._ring()
        if not self._ok:
            log.info("KV log written again")
            self._ok = True
