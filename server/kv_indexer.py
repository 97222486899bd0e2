"""The frontend's KV indexer: follows the KV log into a mirror and writes it back into a Redis that lost it.

Workers write their KV events into Redis themselves (the fast path) and to the KV log (workers/kv_log.py).
Every frontend follows the log's current and previous epoch (each opens with every worker's snapshot) into
a `KVMirror`, assigning the partitions itself (no consumer group: the embedded broker's first group join is
slow). One frontend per model holds a lease in Redis (SET NX PX, renewed every tick); it writes back:

- after Redis came back empty (a new value of the registry marker, read by every round and every router
  lookup): each worker's mirrored blocks, once the mirror has caught up with the log and the worker is
  registered again under the same start time. A worker that is not (killed, restarted, draining) is never
  written back, whatever the log still holds of it;
- when it starts (a cold frontend, perhaps after Redis and every frontend restarted): each registered
  worker whose index entries are fewer than half its mirrored blocks.

It also deletes the log's epochs older than the one before the previous one (a reader may still hold that
one). While a write-back is due, the index is incomplete: `ferry_kv_index_rebuilding` is 1, `/ready` says so,
and the router asks the mirror instead (server/router.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
from aiokafka import TopicPartition
from prometheus_client import Counter, Gauge

from bus.doorbell import Doorbell
from bus.read_spec import Batch, Hooks, Options, Poll
from bus.reader import Reader
from bus.topics import delete_topics, ensure_topics, existing_topics, retention
from kvstore.bells import BellSubscription
from kvstore.kv_index import KVIndex
from kvstore.kv_mirror import KVMirror, WorkerBlocks
from kvstore.lease import lease_script
from schemas.kv_events import KVLogRecord
from schemas.names import RedisKeys, kv_log_topic
from schemas.settings import FrontendSettings
from schemas.status import HEARTBEAT_MISSES, WorkerStatus, status_decoder
from server.metrics import FrontendMetrics

log = logging.getLogger("ferry.frontend")

# How long the caught-up reader sleeps at most between rings: what a lost ring costs, and how late it sees an
# epoch turn that brought no record.
SLEEP_MS = 1000
MAX_RECORDS = 2000
# Epochs further back than this are looked for when deleting old ones (an older one outlived every frontend).
SWEEP_BACK = 12


class KVIndexer:
    """Follow the KV log of one model; rebuild the Redis index from it (see the module docstring)."""

    def __init__(
        self,
        settings: FrontendSettings,
        redis: aioredis.Redis,
        keys: RedisKeys,
        index: KVIndex,
        workers: Callable[[], dict[str, WorkerStatus]],
        metrics: FrontendMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        s = self._s = settings
        self._model = s.served_model_name
        self._redis = redis
        self._keys = keys
        self._index = index
        self._workers = workers  # the frontend's view of the registry
        self._clock = clock
        self.mirror = KVMirror()
        # Once caught up, the reader sleeps between the workers' records, rung by the worker that wrote one
        # (workers/kv_log.py): an idle fleet's log is quiet for minutes, and polling it ten times a second cost
        # the broker and this process about 1 % of a core each. Unsubscribed it polls (bus/doorbell.py).
        self.doorbell = Doorbell() if s.doorbell else None
        self._subscription = (
            None
            if self.doorbell is None
            else BellSubscription(s.redis, keys.kv_log_bell(self._model), "kv-log", self.doorbell)
        )
        self.reader: Reader[KVLogRecord] = Reader(
            f"kv-log {self._model}", s.kafka, msgspec.msgpack.Decoder(KVLogRecord),
            Options(fetch_wait_ms=100, poll=Poll(timeout_ms=500, max_records=MAX_RECORDS), watch_reset=True),
            Hooks(handle=self._handle, before_poll=self._before_poll, after_poll=self._after_poll,
                  may_sleep=lambda: self.caught_up),
            doorbell=self.doorbell,
        )  # fmt: skip
        self._lease = lease_script(redis)
        self._epoch: int | None = None  # the epoch the reader is positioned for
        self._swept: int | None = None  # the epoch whose old topics were last deleted
        self.caught_up = False  # the reader reached the log's end at least once
        self.holder = False
        self._marker: str | None = None  # the registry marker last read
        self._seen = False  # a marker was read once
        # A write-back round is due until then (monotonic), and the workers it has handled.
        self._due_until: float | None = None
        self.handled: set[str] = set()
        self._force = False  # the round follows a marker change: write back whatever Redis holds
        self.rebuilding = False
        self.lag = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # run the next round now, not at the next tick
        r = metrics.registry
        self._g_rebuilding = Gauge(
            "ferry_kv_index_rebuilding", "1 while this frontend knows the KV index lacks workers the KV log has",
            registry=r,
        )  # fmt: skip
        self._g_lag = Gauge("ferry_kv_log_lag_records", "Records of the KV log not read yet", registry=r)
        self._g_holder = Gauge(
            "ferry_kv_indexer_lease", "1 while this frontend's indexer holds the lease", registry=r
        )
        self._c_written = Counter(
            "ferry_kv_index_rebuilt_workers", "Workers whose index entries were written back from the KV log",
            registry=r,
        )  # fmt: skip

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start following the log (positioned by the loop's first round) and the rebuild loop."""
        if self._subscription is not None:
            self._subscription.start()
        await self.reader.start(None)
        self._task = asyncio.create_task(self._loop(), name="kv-indexer")

    async def stop(self) -> None:
        """Stop the loop and the reader; give the lease up."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.stop()
        if self._subscription is not None:
            await self._subscription.stop()
        if self.holder:
            try:
                await self._redis.delete(self._keys.kv_lease(self._model))
            except Exception as exc:
                log.warning("KV indexer lease not given up: %r", exc)

    def overlaps(self, model: str, chain: list[int]) -> dict[str, tuple[int, int]]:
        """The router's lookup answered from the mirror, over the workers the frontend sees."""
        if model != self._model:
            return {}
        return self.mirror.overlaps(chain, self._workers())

    def marker_changed(self, marker: str | None) -> bool:
        """Whether `marker` (read by a router lookup) differs from the one the last round read: Redis lost its
        data in between. The index counts as rebuilding from then on, and the round that starts the write-back
        runs at once instead of up to a quarter heartbeat later."""
        if not self._seen or marker == self._marker:
            return False
        if not self.rebuilding:
            self.rebuilding = True
            self._g_rebuilding.set(1)
            self._wake.set()
        return True

    def detail(self) -> dict[str, Any]:
        """What `/ready` says about the index."""
        return {
            "rebuilding": self.rebuilding, "log_lag": self.lag, "caught_up": self.caught_up,
            "lease": self.holder, "workers": len(self.mirror.workers),
        }  # fmt: skip

    # ---- the reader's hooks ------------------------------------------------------------------------

    def _epoch_now(self) -> int:
        return int(self._clock() // self._s.kv_log_roll_s)

    async def _before_poll(self) -> Poll | None:
        """Read the epoch before the current one and the current one, from wherever the reader is on them;
        once caught up, with workers able to ring, a poll that finds nothing is followed by a long sleep."""
        e = self._epoch_now()
        if e != self._epoch:
            await self._position(e)
        bell = self.doorbell
        return Poll(SLEEP_MS, MAX_RECORDS) if self.caught_up and bell is not None and bell.armed else None

    async def _position(self, e: int) -> None:
        """Assign epochs e - 1 and e (creating them and e + 1 if need be)."""
        topics = [kv_log_topic(self._model, n) for n in (e - 1, e)]
        configs = retention(3 * self._s.kv_log_roll_s, self._s.kafka_retention_bytes)
        await ensure_topics(
            self._s.kafka, {t: 1 for t in [*topics, kv_log_topic(self._model, e + 1)]}, configs
        )
        held = self.reader.consumer.assignment()
        positions: dict[TopicPartition, int] = {}
        for t in topics:
            tp = TopicPartition(t, 0)
            positions[tp] = await self.reader.position(tp) if tp in held else 0
        await self.reader.assign(positions)
        self._epoch = e

    async def _handle(self, batch: Batch[KVLogRecord]) -> None:
        for _record, rec in batch.messages:
            self.mirror.apply(rec)

    async def _after_poll(self, fetched: bool) -> None:
        if not fetched and not self.caught_up:
            self.caught_up = True
            log.info(
                "KV log of %s read: %d worker(s), %d block(s)",
                self._model,
                len(self.mirror.workers),
                self.mirror.blocks(),
            )

    # ---- the rebuild loop --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception as exc:
                log.debug("KV indexer round failed: %r", exc)  # Redis away: the pool logs that once
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._s.heartbeat_interval_s / 4):
                    await self._wake.wait()
            self._wake.clear()

    async def tick(self) -> None:
        """One round: notice an emptied Redis, take or renew the lease, write back what is due, sweep."""
        raw = await self._redis.get(self._keys.registry_marker())
        marker = None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)
        # No marker at all is news too: every registry read sets it, so Redis was just emptied.
        if marker != self._marker and (marker is not None or self._seen):
            if not self._seen:
                self._start_round(force=False)  # a cold start
            elif self._marker is not None:
                log.warning("Redis lost the KV index: writing it back from the KV log")
                self._start_round(force=True)
            self._seen, self._marker = True, marker
        lease_ms = int(HEARTBEAT_MISSES * self._s.heartbeat_interval_s * 1000)
        self.holder = bool(
            await self._lease(keys=[self._keys.kv_lease(self._model)], args=[self._s.frontend_id, lease_ms])
        )
        self._g_holder.set(int(self.holder))
        self.lag = sum((await self.reader.lag()).values())
        self._g_lag.set(self.lag)
        if self._due_until is not None and self.caught_up:
            if self.holder:
                await self._write_back()
            elif await self._redis.get(self._keys.kv_rebuilt(self._model)) == (self._marker or "").encode():
                self._due_until = None  # the holder did it
            if self._due_until is not None and not self._candidates():
                self._due_until = None
                if self.holder and self._marker is not None:
                    await self._redis.set(self._keys.kv_rebuilt(self._model), self._marker)
            elif self._due_until is not None and time.monotonic() > self._due_until:
                log.warning(
                    "KV index: %d worker(s) never registered again; not written back", len(self._candidates())
                )
                self._due_until = None
        if self._due_until is None:
            self.rebuilding = False
        self._g_rebuilding.set(int(self.rebuilding))
        if self.holder:
            await self._sweep()
        self._forget_gone()

    def _start_round(self, force: bool) -> None:
        """A write-back is due; `force`: Redis lost everything (else: a cold start, only what it lacks)."""
        self._force = self.rebuilding = force
        self._due_until = time.monotonic() + 2 * HEARTBEAT_MISSES * self._s.heartbeat_interval_s
        self.handled = set()
        self._g_rebuilding.set(int(self.rebuilding))

    def _candidates(self) -> dict[str, WorkerBlocks]:
        """Mirrored workers the frontend knows (kept ones too) not yet written back or rejected this round."""
        view = self._workers()
        return {w: b for w, b in self.mirror.workers.items() if w in view and w not in self.handled}

    async def _registered(self, ids: list[str]) -> dict[str, WorkerStatus]:
        """The registry's statuses of these workers now (not the frontend's view, which keeps lost ones)."""
        raw = await self._redis.mget([self._keys.worker(w) for w in ids]) if ids else []
        out: dict[str, WorkerStatus] = {}
        for wid, value in zip(ids, raw, strict=True):
            if value is not None:
                try:
                    out[wid] = status_decoder.decode(value if isinstance(value, bytes) else value.encode())
                except msgspec.DecodeError:
                    continue
        return out

    async def _write_back(self) -> None:
        """Write back the candidates that are registered again under the process the log knows."""
        candidates = self._candidates()
        registered = await self._registered(list(candidates))
        todo: dict[str, WorkerBlocks] = {}
        for wid, blocks in candidates.items():
            st = registered.get(wid)
            if st is None:
                continue  # not registered (again) yet: maybe later, until the deadline
            self.handled.add(wid)
            if st.started_at != blocks.incarnation or st.draining or st.model != self._model:
                continue  # another process under this id, or one that left routing: the log is not its cache
            todo[wid] = blocks
        if not self._force and todo:
            # A cold start: only workers whose entries Redis lost.
            async with self._redis.pipeline(transaction=False) as pipe:
                for wid in todo:
                    pipe.scard(self._keys.worker_blocks(wid))
                held = await pipe.execute()
            todo = {w: b for (w, b), n in zip(todo.items(), held, strict=True) if n * 2 < len(b)}
        if todo:
            t0 = time.perf_counter()
            await self._index.replace_workers(self._model, {w: (b.device, b.host) for w, b in todo.items()})
            self._c_written.inc(len(todo))
            log.info(
                "KV index: wrote back %d worker(s), %d block(s) from the KV log in %.0f ms",
                len(todo), sum(len(b) for b in todo.values()), 1000 * (time.perf_counter() - t0),
            )  # fmt: skip

    async def _sweep(self) -> None:
        """Delete the log's epochs older than the one before the previous one (once per epoch)."""
        e = self._epoch_now()
        if self._swept == e:
            return
        self._swept = e
        # Not e - 2 yet: a reader that has not polled since the turn still holds it, and its next fetch of
        # a deleted topic would bring it back empty (the embedded broker's quirk), read as a lost log.
        old = [kv_log_topic(self._model, n) for n in range(e - SWEEP_BACK, e - 2)]
        found = await existing_topics(self._s.kafka, old)
        if found:
            await delete_topics(self._s.kafka, found)
            log.info("KV log: deleted %d old epoch(s)", len(found))

    def _forget_gone(self) -> None:
        """Drop workers the frontend no longer sees that wrote nothing for two epochs."""
        live, old = self._workers(), self._clock() - 2 * self._s.kv_log_roll_s
        for wid in [w for w, b in self.mirror.workers.items() if w not in live and b.ts < old]:
            self.mirror.forget(wid)
