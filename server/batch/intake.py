"""The Kafka-native batch path: items produced to `ferry.batch.submit.<model>`, results to a topic of the producer's.

A service that already speaks Kafka produces one JSON `KafkaBatchItem` per request (an input-file line
plus `reply_topic`). The frontends read the submit topic as one consumer group, prepare each item
exactly as an uploaded line (same validation, template, tokenizer), store what its result line needs
in Redis and put it on the pool topic; the offset is committed once the pool has the item. The result
(an `OutputLine`, JSON, key = `custom_id`) goes to `reply_topic` once, whichever frontend collects it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer

from bus.read_spec import Batch, Hooks, Options, Poll, Subscribe
from bus.reader import Reader
from kvstore.batch_store import BatchStore
from schemas.batch import KafkaBatchItem, kafka_item_decoder
from schemas.names import batch_submit_group, batch_submit_topic
from schemas.status import WorkerStatus
from server.batch.items import ItemPreparer, error_line
from server.batch.ordering import partition_for
from server.batch.rolling import BatchTopics
from server.errors import APIError

log = logging.getLogger("ferry.batch")

# How long a Kafka-native item's metadata and its "result sent" mark are kept.
ITEM_TTL_S = 7 * 24 * 3600


def native_item_id(partition: int, offset: int, timestamp: int) -> str:
    """Id of a Kafka-native item: stable across redeliveries of the same message."""
    return f"kitem-{partition}-{offset}-{timestamp}"


class KafkaIntake:
    """One frontend's member of the submit topic's consumer group."""

    def __init__(
        self,
        bootstrap: str,
        model: str,
        store: BatchStore,
        preparer: ItemPreparer,
        producer: AIOKafkaProducer,
        live_workers: Callable[[], list[WorkerStatus]],
        fetch_wait_ms: int,
        topics: BatchTopics,
    ) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.on_items: Callable[[], None] | None = None  # an item is in the pool: ring its sleeping readers
        self.model = model
        self.topic = batch_submit_topic(model)
        self.store = store
        self.preparer = preparer
        self.producer = producer
        self.live_workers = live_workers
        self.fetch_wait_ms = fetch_wait_ms
        self._reader = Reader(
            "batch intake",
            bootstrap,
            kafka_item_decoder,
            Options(
                fetch_wait_ms=fetch_wait_ms,
                poll=Poll(200, 256),
                group_id=batch_submit_group(model),
                offset_reset="earliest",
            ),
            Hooks(self._handle, before_poll=self._wait_for_workers, error=self._retry),
        )
        self.items_taken = 0

    async def start(self) -> None:
        """Join the group and start taking items."""
        await self._reader.start(Subscribe((self.topic,)))

    async def stop(self) -> None:
        """Leave the group; uncommitted items are taken by another frontend."""
        with contextlib.suppress(Exception):
            await self._reader.stop()

    async def _wait_for_workers(self) -> None:
        while not self.live_workers():  # noqa: ASYNC110 - the worker view (Redis) sets no event
            await asyncio.sleep(0.5)  # nothing can be prepared without a worker's context length

    async def _handle(self, batch: Batch[KafkaBatchItem]) -> None:
        for record, msg in batch.messages:
            await self._take(batch.tp.partition, record.offset, record.timestamp, msg)
        await self._reader.commit({batch.tp: batch.end})

    async def _retry(self, exc: Exception) -> bool:
        # Broker or Redis trouble: the uncommitted items are read again.
        log.warning("batch intake: %r; retrying from the last commit", exc)
        await asyncio.sleep(0.5)  # back-off before the next attempt
        with contextlib.suppress(Exception):  # the broker may still be away; the next pass retries
            await self._reader.rewind_to_committed()
        return True

    async def _take(self, partition: int, offset: int, timestamp: int, msg: KafkaBatchItem) -> None:
        workers = self.live_workers()
        max_len = min(w.max_model_len for w in workers)
        block_size = workers[0].block_size
        item = native_item_id(partition, offset, timestamp)
        try:
            prepared = await self.preparer.prepare(
                item, 0, msg.custom_id, msg.url, bytes(msg.body), max_len, 0.0, reply_topic=msg.reply_topic
            )
        except APIError as err:
            if await self.store.claim_item(item, ITEM_TTL_S):
                await self.producer.send_and_wait(
                    msg.reply_topic, error_line(msg.custom_id, err), key=msg.custom_id.encode()
                )
            return
        await self.store.put_item(item, prepared.meta, ITEM_TTL_S)
        topic = await self.topics.pool_now()  # the epoch of the clock, with --pool-roll-s
        parts = await self.producer.partitions_for(topic)
        partition_out = partition_for(prepared.first_prompt, len(parts), self.model, block_size)
        await self.producer.send_and_wait(topic, prepared.message, key=item.encode(), partition=partition_out)
        if self.on_items is not None:
            self.on_items()
        self.items_taken += 1
