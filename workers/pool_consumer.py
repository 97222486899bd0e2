"""Batch work for a worker: a consumer-group member of `ferry.pool.<model>` that fills spare capacity.

Every worker of a model reads the pool topic as one consumer group, so each item goes to one of
them. A worker fetches only while its engine has room: nothing waiting, KV usage under a limit, and
fewer than `--pool-max-inflight` batch sequences of its own; otherwise its partitions are paused
(paused partitions drop what was prefetched, so nothing is taken that cannot start now). Batch
items carry a low engine priority, so interactive requests that arrive later still run first.

Items run through the worker's ordinary request path, so their chunks go to the batch results topic
like any reply. An item's offset is committed only after its last chunk has been acknowledged by
the broker; an item that was interrupted (worker stopping, engine dead) is never marked done, so
whoever owns the partition next runs it again. Delivery is therefore at least once; the batch
coordinator keeps one result per item. An item that kills every engine it meets would take the whole pool
down, again as workers restart: at ENGINE_DEATHS_LIMIT deaths before its first token it ends with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from bus.doorbell import Doorbell
from bus.epochs import metadata_age_ms
from bus.read_spec import BATCH_SLEEP_MS, Batch, Hooks, Poll, Subscribe, batch_options
from bus.reader import Reader
from kvstore.batch_store import BatchStore
from kvstore.bells import BellSubscription
from schemas.kafka import (
    ENGINE_DEATHS_LIMIT,
    REPEATED_ENGINE_DEATH,
    Chunk,
    ErrorInfo,
    GenerateRequest,
    PoolItem,
    joined_chunk,
    pool_decoder,
)
from schemas.names import RedisKeys, pool_group, pool_pattern, pool_topic
from schemas.settings import WorkerSettings
from workers.engine import Engine
from workers.pool_metrics import PoolMetrics

log = logging.getLogger("ferry.worker.pool")

# How long a cancelled or expired batch is remembered by workers.
_STOPPED_HORIZON_S = 7 * 24 * 3600.0
_DEATHS_TTL_S = 7 * 24 * 3600  # how long an item's engine deaths are counted


class PoolHost(Protocol):
    """What the pool consumer needs from its worker."""

    engine: Engine

    def start_request(self, req: GenerateRequest) -> asyncio.Task[None] | None:
        """Run one request like one from the worker's own topic; None if it is already running."""
        ...

    def running_task(self, request_id: str) -> asyncio.Task[None] | None:
        """The task serving `request_id`, if it is running."""
        ...

    async def flush_replies(self, timeout_s: float) -> bool:
        """Wait until every queued reply chunk is acknowledged; False if that did not happen in time."""
        ...

    def send_final(self, req: GenerateRequest, chunk: Chunk) -> None:
        """Queue the last chunk of a request that is not run here."""
        ...

    @property
    def engine_dead(self) -> bool:
        """True once the worker's engine died or hung (what stopped it, if it stopped)."""
        ...

    @property
    def failed(self) -> bool:
        """True once the worker hit a fatal error (nothing it finishes now counts)."""
        ...

    def fail(self, exc: BaseException) -> None:
        """A background part of the worker died: the worker stops."""
        ...


class PartitionTrack:
    """Offsets taken from one partition and whether each item is done; gives the offset to commit."""

    def __init__(self) -> None:
        self.offsets: OrderedDict[int, bool] = OrderedDict()
        self.next_offset: int | None = None
        self.committed: int | None = None

    def take(self, offset: int) -> None:
        """Note an offset fetched (offsets of one partition arrive in increasing order)."""
        self.offsets.setdefault(offset, False)
        self.next_offset = max(self.next_offset or 0, offset + 1)

    def done(self, offset: int) -> None:
        """The item at `offset` has its result sent."""
        if offset in self.offsets:
            self.offsets[offset] = True

    def commit_point(self) -> int | None:
        """The first offset not yet done (everything before it is), if it moved past what is committed."""
        while self.offsets:
            offset, done = next(iter(self.offsets.items()))
            if not done:
                point = offset
                break
            self.offsets.popitem(last=False)
        else:
            point = self.next_offset  # type: ignore[assignment]
        if point is None or (self.committed is not None and point <= self.committed):
            return None
        return point


@dataclass
class _ItemRun:
    item: PoolItem
    tasks: list[asyncio.Task[None]]
    places: list[tuple[PartitionTrack, int]] = field(default_factory=list)


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: PoolConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.owner._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.owner._on_assigned(assigned)


class PoolConsumer:
    """One worker's membership in its model's pool consumer group."""

    def __init__(
        self, settings: WorkerSettings, host: PoolHost, store: BatchStore, registry: CollectorRegistry
    ) -> None:
        self.settings = settings
        self.host = host
        self.store = store
        self.metrics = PoolMetrics(registry)
        self.topic = pool_topic(settings.served_model_name)
        session_ms = int(settings.pool_session_timeout_s * 1000)
        # An empty pool is read when a frontend rings that it wrote items (server/batch) or every BATCH_SLEEP_MS,
        # not twice a second by every worker (docs/benchmarks.md, "A quiet fleet").
        self.doorbell = Doorbell() if settings.doorbell else None
        channel = RedisKeys(settings.redis_prefix).pool_bell(settings.served_model_name)
        self.bell_subscription = (
            None if self.doorbell is None else BellSubscription(settings.redis, channel, "pool", self.doorbell)
        )
        self._reader = Reader(
            "pool",
            settings.kafka,
            pool_decoder,
            # Batch items wait for spare capacity anyway, so a late answer to a parked fetch costs them nothing
            # worth the CPU of polling an idle pool every few ms (bench.overhead --peer).
            batch_options(
                settings.kafka_fetch_wait_ms,
                group_id=pool_group(settings.served_model_name),
                client_id=f"ferry-pool-{settings.worker_id}",
                offset_reset="earliest",
                session_timeout_ms=session_ms,
                heartbeat_interval_ms=max(100, session_ms // 5),
                # Adjacent partitions hold adjacent runs of a prefix-ordered batch: keep them on one worker.
                range_assignor=True,
                # A drain must not wait on a join that waits on other members (bus/consumer.py); after the
                # session timeout the broker would drop a member that left without a word anyway.
                join_wait_s=settings.pool_session_timeout_s,
                metadata_max_age_ms=metadata_age_ms(settings.pool_roll_s),
            ),
            Hooks(
                self._handle,
                failed=host.fail,
                before_poll=self._make_room,
                after_poll=self._wait_for_room,
                error=self._fetch_failed,
            ),
            doorbell=self.doorbell,
        )
        self._room_now = 0
        self._loops: list[asyncio.Task[None]] = []
        self._tracks: dict[TopicPartition, PartitionTrack] = {}
        self._runs: dict[str, _ItemRun] = {}
        self._sequences = 0
        # Batch sequences running here, and the chunks each produced so far (see `coalesce`).
        self._pool_requests: set[str] = set()
        self._partial: dict[str, list[Chunk]] = {}
        self._produced: set[str] = set()  # batch sequences that produced a token here
        # Items in flight when the engine died, none of whose sequences had produced anything: counted on leaving.
        self._dead_starts: set[str] = set()
        self._stopped: set[str] = set()
        self._taking = True
        self._room = asyncio.Event()
        self._commit_wanted = asyncio.Event()
        self.joined = asyncio.Event()  # set once the group gave this worker its partitions

    # ---- lifecycle -------------------------------------------------------------------------------

    @property
    def reader(self) -> Reader[Any]:
        """The pool topic's reader (for its consumer lag)."""
        return self._reader

    async def start(self) -> None:
        """Join the group (the topic is created by whoever needs it first).

        With `--pool-roll-s` the member reads every epoch the broker lists (and the unrolled topic), by
        pattern: a worker that joins late still reads the epochs not yet consumed, and an epoch a frontend
        deleted is not asked for by name (which would re-create it on the embedded broker).
        """
        pattern = pool_pattern(self.settings.served_model_name) if self.settings.pool_roll_s > 0 else None
        await self._reader.open(Subscribe((self.topic,), _Rebalance(self), pattern))
        if self.bell_subscription is not None:
            self.bell_subscription.start()

    def run(self) -> None:
        """Fetch items while there is room, until `stop_taking`; commits go on in the background."""
        self._loops = [
            asyncio.create_task(self._commit_loop(), name="pool-commit"),
            asyncio.create_task(self._stopped_loop(), name="pool-stopped"),
        ]
        self._reader.run()

    def stop_taking(self) -> None:
        """Take no more items (drain): running ones finish through the worker's own drain."""
        self._taking = False
        self._reader.finish()
        for t in self._loops:
            t.cancel()
        self._room.set()

    async def close(self, commit: bool = True) -> None:
        """Commit what is done (unless the worker failed) and leave the group, which hands our partitions on."""
        if not self._reader.started:
            return
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if commit and not self.host.failed:
            await self._commit(force_flush=True)
        if self._dead_starts:
            # Before leaving the group: whoever takes our partitions next must see the count.
            try:
                async with asyncio.timeout(2.0):
                    await self.store.note_engine_deaths(self._dead_starts, _DEATHS_TTL_S)
            except Exception as exc:
                log.warning("could not count the engine death against %d batch item(s): %r", len(self._dead_starts), exc)
        with contextlib.suppress(Exception):
            await self._reader.stop()
        if self.bell_subscription is not None:
            await self.bell_subscription.stop()

    # ---- the reader's hooks ----------------------------------------------------------------------

    async def _make_room(self) -> Poll:
        room = self._room_now = self._room_for()
        self._set_paused(self._reader.consumer, room <= 0)
        # With room and a bell that can ring, the next sleep lasts BATCH_SLEEP_MS (bus/reader.py).
        asleep = self.doorbell is not None and self.doorbell.armed
        return Poll(timeout_ms=0 if room <= 0 else BATCH_SLEEP_MS if asleep else 200, max_records=max(1, room))

    async def _handle(self, batch: Batch[PoolItem]) -> None:
        track = self._tracks.get(batch.tp)
        if track is None:  # revoked while the records were on their way
            return
        for record in batch.dropped:  # logged by the reader; done, so commits pass over it
            self.metrics.items.labels("undecodable").inc()
            track.take(record.offset)
            track.done(record.offset)
        deaths = await self._engine_deaths([item.item_id for _, item in batch.messages])
        for (record, item), died in zip(batch.messages, deaths, strict=True):
            if died >= ENGINE_DEATHS_LIMIT:
                self._refuse(track, record.offset, item, died)
            else:
                self._take(track, record.offset, item)

    async def _engine_deaths(self, item_ids: list[str]) -> list[int]:
        with contextlib.suppress(Exception):  # Redis away: the items run (a count only stops a runaway)
            async with asyncio.timeout(2.0):
                return await self.store.engine_deaths(item_ids)
        return [0] * len(item_ids)

    def _refuse(self, track: PartitionTrack, offset: int, item: PoolItem, died: int) -> None:
        """End an item that killed `died` engines before it produced anything, without running it."""
        log.error("batch item %s: %d engines died while starting it; ending it with an error", item.item_id, died)
        why = f"{died} engines died while starting this request; it is not retried, as it may be what kills them"
        error = ErrorInfo(REPEATED_ENGINE_DEATH, why)
        for req in item.requests:
            chunk = Chunk(req.request_id, 0, finish_reason="error", error=error, worker_id=self.settings.worker_id)
            self.host.send_final(req, chunk)
        self.metrics.items.labels("refused").inc()
        track.take(offset)
        track.done(offset)
        self._commit_wanted.set()

    async def _wait_for_room(self, got_records: bool) -> None:
        if self._room_now <= 0:
            # Room comes back when an item ends or the engine's load drops: check often.
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._room.wait()

    async def _fetch_failed(self, exc: Exception) -> bool:
        if not isinstance(exc, KafkaError):
            return False
        log.warning("pool fetch failed: %r", exc)
        return True

    # ---- taking items ----------------------------------------------------------------------------

    def _room_for(self) -> int:
        """How many more batch sequences this worker should take now."""
        if not self._taking or self.host.failed:
            return 0
        st = self.host.engine.stats()
        s = self.settings
        if st.waiting > 0 or st.kv_usage >= s.pool_max_kv_usage:
            return 0
        return max(0, min(s.pool_max_inflight - self._sequences, s.max_num_seqs - st.running))

    def _set_paused(self, consumer: AIOKafkaConsumer, pause: bool) -> None:
        assigned = consumer.assignment()
        if pause:
            todo = [tp for tp in assigned if tp not in consumer.paused()]
            if todo:
                consumer.pause(*todo)
        elif consumer.paused():
            consumer.resume(*consumer.paused())
        self.metrics.paused.set(1 if pause and assigned else 0)

    def _take(self, track: PartitionTrack, offset: int, item: PoolItem) -> None:
        track.take(offset)
        if item.batch_id and item.batch_id in self._stopped:
            self.metrics.items.labels("stopped").inc()
            track.done(offset)
            return
        deadlines = [r.deadline for r in item.requests if r.deadline]
        if deadlines and min(deadlines) < time.time():
            # The batch's window is over; the coordinator writes its `expired` line.
            self.metrics.items.labels("expired").inc()
            track.done(offset)
            return
        run = self._runs.get(item.item_id)
        if run is not None:  # redelivered after a rebalance while still running here
            run.places.append((track, offset))
            return
        tasks: list[asyncio.Task[None]] = []
        for req in item.requests:
            self._pool_requests.add(req.request_id)
            task = self.host.start_request(req) or self.host.running_task(req.request_id)
            if task is not None:
                tasks.append(task)
        run = _ItemRun(item, tasks, [(track, offset)])
        self._runs[item.item_id] = run
        self._sequences += len(tasks)
        self.metrics.inflight.set(self._sequences)
        if not tasks:
            self._finish(run)
            return
        remaining = [len(tasks)]

        def one_done(_t: asyncio.Task[None]) -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                self._finish(run)

        for t in tasks:
            t.add_done_callback(one_done)

    def _finish(self, run: _ItemRun) -> None:
        self._runs.pop(run.item.item_id, None)
        ids = [req.request_id for req in run.item.requests]
        produced = any(rid in self._produced for rid in ids)
        for rid in ids:
            self._pool_requests.discard(rid)
            self._partial.pop(rid, None)
            self._produced.discard(rid)
        self._sequences -= len(run.tasks)
        self.metrics.inflight.set(self._sequences)
        interrupted = self.host.failed or any(t.cancelled() for t in run.tasks)
        if interrupted:
            # Not done: whoever owns the partition next runs it again.
            self.metrics.items.labels("interrupted").inc()
            if self.host.engine_dead and not produced:
                self._dead_starts.add(run.item.item_id)
        else:
            self.metrics.items.labels("done").inc()
            for track, offset in run.places:
                track.done(offset)
            self._commit_wanted.set()
        self._room.set()

    def coalesce(self, req: GenerateRequest, chunk: Chunk) -> Chunk | None:
        """A batch sequence's output in one chunk: None while it runs, everything at its end.

        Nobody reads a batch item token by token, and one Kafka record per token per sequence is most
        of what a busy batch costs the worker, the broker and the frontend; interactive requests share
        those. Other requests' chunks pass through unchanged.
        """
        if req.request_id not in self._pool_requests:
            return chunk
        parts = self._partial.setdefault(req.request_id, [])
        parts.append(chunk)
        if chunk.token_ids:
            self._produced.add(req.request_id)
        if chunk.finish_reason is None:
            return None
        del self._partial[req.request_id]
        # The item's output as one chunk, numbered 0 and standing for itself alone, as the batch results take it.
        return msgspec.structs.replace(joined_chunk(parts), seq=0, span=1)

    # ---- stopped batches -------------------------------------------------------------------------

    async def _stopped_loop(self) -> None:
        while True:
            try:
                stopped = await self.store.stopped_since(time.time() - _STOPPED_HORIZON_S)
            except Exception as exc:  # Redis down: keep what we knew, items just run
                log.debug("could not read stopped batches: %r", exc)
            else:
                new = stopped - self._stopped
                self._stopped = stopped
                if new:
                    await self._abort_batches(new)
            await asyncio.sleep(self.settings.heartbeat_interval_s)  # polling period

    async def _abort_batches(self, batch_ids: set[str]) -> None:
        for run in list(self._runs.values()):
            if run.item.batch_id in batch_ids:
                for req in run.item.requests:
                    await self.host.engine.abort(req.request_id)

    # ---- commits ---------------------------------------------------------------------------------

    async def _commit_loop(self) -> None:
        while True:
            await self._commit_wanted.wait()
            self._commit_wanted.clear()
            await self._commit()
            # Batches commits: at most a few per second whatever the item rate.
            await asyncio.sleep(0.2)

    async def _commit(self, force_flush: bool = False, only: list[TopicPartition] | None = None) -> None:
        if not self._reader.started:
            return
        points = {
            tp: p
            for tp, track in self._tracks.items()
            if (only is None or tp in only) and (p := track.commit_point()) is not None
        }
        if not points:
            return
        # The points were taken before the flush, so every result they cover is on the broker after it.
        if not await self.host.flush_replies(5.0 if force_flush else 2.0):
            self._commit_wanted.set()
            return
        try:
            await self._reader.commit(points)
        except (KafkaError, TimeoutError) as exc:
            log.info("pool commit failed (%r); the items will be retried from the last commit", exc)
            return
        self.metrics.commits.inc()
        for tp, p in points.items():
            track = self._tracks.get(tp)
            if track is not None:
                track.committed = p

    async def _on_revoked(self, revoked: list[TopicPartition]) -> None:
        await self._commit(only=list(revoked))
        for tp in revoked:
            self._tracks.pop(tp, None)
        # Items from these partitions still running here finish; their next owner may run them too.

    def _on_assigned(self, assigned: list[TopicPartition]) -> None:
        for tp in assigned:
            self._tracks[tp] = PartitionTrack()
        log.info(
            "worker %s takes batch work from %s",
            self.settings.worker_id,
            sorted(f"{tp.topic}[{tp.partition}]" for tp in assigned),
        )
        self.joined.set()
        if self.doorbell is not None:
            self.doorbell.ring()  # items may wait there (a member that left): no writer rings for them
