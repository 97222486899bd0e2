"""Reads `ferry.batch.results.<model>`: turns each finished item's chunks into its one output line.

The frontends of a model read the results topic as one consumer group. Offsets are committed only
up to the first chunk of the oldest item still open, so a frontend that dies hands every unfinished
item to the next one, which reads their chunks again. Lines are recorded through a Lua script that
keeps the first line of each item (`kvstore/batch_store.py`), so reading a chunk twice, or an item
running twice, still gives one line. Kafka-native items get their line produced to the topic their
producer named instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from bus.doorbell import Doorbell
from bus.epochs import metadata_age_ms
from bus.read_spec import BATCH_SLEEP_MS, Batch, Hooks, Poll, Subscribe, batch_options
from bus.reader import Reader
from kvstore.batch_store import BatchStore
from schemas.batch import ItemMeta
from schemas.kafka import Chunk, ReplyMessage, chunks_of, reply_decoder
from schemas.names import batch_results_group, batch_results_pattern, batch_results_topic
from schemas.tenants import UsageRecord
from server.batch.items import response_line, split_item_id, split_sequence_id, unrun_line
from server.batch.lines import ItemChunks, ItemResult, build, sequences_of
from server.logprobs import LogprobFormatter

log = logging.getLogger("ferry.batch")

# Items whose metadata is unknown here (another deployment's prefix, a forgotten item) are remembered
# for a while so their chunks are dropped without asking Redis each time.
_FOREIGN_MEMORY = 10_000
# Open items of batches that ended are dropped after this long without news.
_STALE_S = 60.0
# Most records one poll hands on (the consumer's fetches, its polls and the long poll before a sleep alike).
_MAX_RECORDS = 2048


class _Joined(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, event: asyncio.Event, on_revoked: Callable[[], None], bell: Doorbell | None) -> None:
        self.event = event
        self.on_revoked = on_revoked
        self.bell = bell

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        if revoked:
            self.on_revoked()

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        self.event.set()
        if self.bell is not None:
            self.bell.ring()  # results may wait there (a frontend that left): no worker rings for them


class ResultCollector:
    """One frontend's member of the results consumer group."""

    def __init__(
        self,
        bootstrap: str,
        model: str,
        store: BatchStore,
        fmt: LogprobFormatter,
        producer: AIOKafkaProducer,
        fetch_wait_ms: int,
        on_complete: Callable[[str], None],
        on_usage: Callable[[UsageRecord], Awaitable[None]] | None = None,
        roll_s: float = 0.0,
        doorbell: Doorbell | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = batch_results_topic(model)
        self.group = batch_results_group(model)
        self.store = store
        self.fmt = fmt
        self.producer = producer
        self.fetch_wait_ms = fetch_wait_ms
        self.on_complete = on_complete
        self.on_usage = on_usage  # a tenant's item was recorded (once): its usage (server/tenants_usage.py)
        self._open: dict[str, ItemChunks] = {}
        # Per open item, the offset of its first chunk in each partition holding one: with --pool-roll-s an
        # item's sequences can end in different epochs, and each partition's commit waits for its own.
        self._holds: dict[str, dict[TopicPartition, int]] = {}
        self._pattern = batch_results_pattern(model) if roll_s > 0 else None
        self._metas: dict[str, ItemMeta] = {}
        self._foreign: OrderedDict[str, None] = OrderedDict()
        self._next: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}  # the points of the last commit
        # Rung by the worker whose result is in (workers/reply_bells.py): an idle reader polls every BATCH_SLEEP_MS.
        self.doorbell = doorbell
        self._last_commit = self._last_gc = time.monotonic()
        self._reader = Reader(
            "batch results",
            bootstrap,
            reply_decoder,
            batch_options(
                fetch_wait_ms,
                poll=Poll(200, _MAX_RECORDS),
                group_id=self.group,
                offset_reset="earliest",
                max_poll_records=_MAX_RECORDS,
                # With --pool-roll-s each epoch is a topic of one partition; the range assignor gives
                # partition 0 of every topic to the same member, so one frontend sees every chunk of an item
                # even when its sequences ended in different epochs (round-robin would split them). Without
                # rolling, aiokafka's default: members of another version still share the group's protocol.
                range_assignor=roll_s > 0,
                metadata_max_age_ms=metadata_age_ms(roll_s),
            ),
            Hooks(self._handle, after_poll=self._tend, error=self._retry, closing=self._last_commit_quietly,
                  before_poll=self._poll, before_sleep=self._commit),
            doorbell=doorbell,
        )  # fmt: skip
        self.lines_recorded = 0
        self.joined = asyncio.Event()  # set once the group gave this frontend its share of the topic

    @property
    def reader(self) -> Reader[ReplyMessage]:
        """The results topic's reader."""
        return self._reader

    async def start(self) -> None:
        """Join the group and start reading."""
        self._last_commit = self._last_gc = time.monotonic()
        await self._reader.start(
            Subscribe((self.topic,), _Joined(self.joined, self._forget_open, self.doorbell), self._pattern)
        )

    async def stop(self) -> None:
        """Commit what is safe and leave the group (another frontend takes over at once)."""
        with contextlib.suppress(Exception):
            await self._reader.stop()

    async def _poll(self) -> Poll | None:
        """A long poll (the sleep that follows an empty one) while a ring can wake the reader."""
        bell = self.doorbell
        return Poll(BATCH_SLEEP_MS, _MAX_RECORDS) if bell is not None and bell.armed else None

    async def _tend(self, got_records: bool) -> None:
        """After each poll: commit what is safe twice a second, forget stale items every 10 s."""
        now = time.monotonic()
        if now - self._last_commit > 0.5:
            await self._commit()
            self._last_commit = now
        if now - self._last_gc > 10.0:
            await self._drop_stale()
            self._last_gc = now

    async def _retry(self, exc: Exception) -> bool:
        # Broker or Redis trouble: the uncommitted chunks are read again.
        log.warning("batch results: %r; retrying", exc)
        await asyncio.sleep(0.5)  # back-off before the next attempt
        return True

    async def _last_commit_quietly(self) -> None:
        with contextlib.suppress(Exception):
            await self._commit()

    async def _handle(self, batch: Batch[ReplyMessage]) -> None:
        tp = batch.tp
        self._next[tp] = batch.end
        chunks: list[tuple[int, str, int, Chunk]] = []
        for record, message in batch.messages:
            # A record with several items' chunks is committed past only once all of them are (same offset).
            for chunk in chunks_of(message):
                split = split_sequence_id(chunk.request_id)
                if split is None or split[0] in self._foreign:
                    continue
                chunks.append((record.offset, split[0], split[1], chunk))
        await self._load_metas({item for _, item, _, _ in chunks})
        for offset, item, k, chunk in chunks:
            meta = self._metas.get(item)
            if meta is None:
                continue
            state = self._open.get(item)
            if state is None:
                state = self._open[item] = ItemChunks(first_offset=offset)
            self._holds.setdefault(item, {}).setdefault(tp, offset)
            state.seen_at = time.monotonic()
            state.add(k, chunk)
            if state.finished(sequences_of(meta)):
                await self._finish(item, meta, state)

    async def _load_metas(self, items: set[str]) -> None:
        wanted = [i for i in items if i not in self._metas]
        by_batch: dict[str, list[tuple[str, int]]] = {}
        native: list[str] = []
        for item in wanted:
            split = split_item_id(item)
            if split is None:
                native.append(item)
            else:
                by_batch.setdefault(split[0], []).append((item, split[1]))
        for batch_id, entries in by_batch.items():
            metas = await self.store.item_metas(batch_id, [i for _, i in entries])
            for (item, _), meta in zip(entries, metas, strict=True):
                self._remember(item, meta)
        if native:
            for item, meta in zip(native, await self.store.get_items(native), strict=True):
                self._remember(item, meta)

    def _remember(self, item: str, meta: ItemMeta | None) -> None:
        if meta is not None:
            self._metas[item] = meta
            return
        self._foreign[item] = None
        if len(self._foreign) > _FOREIGN_MEMORY:
            self._foreign.popitem(last=False)

    async def _finish(self, item: str, meta: ItemMeta, state: ItemChunks) -> None:
        result = build(meta, state, self.fmt)
        if result.aborted:
            line = unrun_line(
                meta.custom_id,
                "request_aborted",
                "The batch was cancelled or expired while this request ran.",
            )
        else:
            line = response_line(meta.custom_id, result.status, result.body)
        split = split_item_id(item)
        if split is not None:
            res = await self.store.record(
                split[0],
                split[1],
                line,
                result.ok,
                result.input_tokens,
                result.cached_tokens,
                result.output_tokens,
            )
            if res >= 0:
                self.lines_recorded += 1
                if meta.tenant and self.on_usage is not None:
                    await self.on_usage(_usage(meta, result))
            if res == 1:
                self.on_complete(split[0])
        elif meta.reply_topic and await self.store.claim_item(item, 7 * 24 * 3600):
            try:
                await self.producer.send_and_wait(meta.reply_topic, line, key=meta.custom_id.encode())
            except KafkaError:
                await self.store.unclaim_item(item)
                raise
            self.lines_recorded += 1
        self._open.pop(item, None)
        self._holds.pop(item, None)
        self._metas.pop(item, None)

    def _forget_open(self) -> None:
        """The partition moves: whoever gets it reads the open items' chunks again from our last commit."""
        self._open.clear()
        self._holds.clear()
        self._metas.clear()
        self._next.clear()
        self._committed = {}

    async def _commit(self) -> None:
        if not self._next:
            return
        points = {}
        assigned = self._reader.consumer.assignment()
        for tp in [tp for tp in self._next if tp not in assigned]:
            del self._next[tp]  # moved to another frontend, which reads from our last commit
        for tp, nxt in self._next.items():
            # Workers write to partition 0 of each results topic; open items hold back their partitions.
            points[tp] = min((h[tp] for h in self._holds.values() if tp in h), default=nxt)
            points[tp] = min(points[tp], nxt)
        if points == self._committed:
            return
        try:
            await self._reader.commit(points)
            self._committed = points
        except (KafkaError, TimeoutError) as exc:
            log.info("batch results commit failed: %r", exc)

    async def _drop_stale(self) -> None:
        """Forget open items of batches that ended (their runs will never finish)."""
        now = time.monotonic()
        active = set(await self.store.active_batches())
        for item, state in list(self._open.items()):
            split = split_item_id(item)
            if split is not None and split[0] not in active and now - state.seen_at > _STALE_S / 6:
                self._open.pop(item, None)
                self._holds.pop(item, None)
                self._metas.pop(item, None)
            elif split is None and now - state.seen_at > _STALE_S * 60:
                self._open.pop(item, None)
                self._holds.pop(item, None)
                self._metas.pop(item, None)


def _usage(meta: ItemMeta, result: ItemResult) -> UsageRecord:
    """One batch item's usage for its tenant: a failed item is charged its prompt, an aborted one nothing."""
    prompt = result.input_tokens if result.ok else 0 if result.aborted else sum(meta.prompt_lens)
    return UsageRecord(
        at=time.time(), tenant=meta.tenant, key_id=meta.key_id, model=meta.model, errors=int(not result.ok),
        prompt_tokens=prompt, cached_tokens=result.cached_tokens, completion_tokens=result.output_tokens,
    )  # fmt: skip
