"""Everything batch a frontend runs, started and stopped with it: store, coordinator, results, Kafka intake."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from bus.doorbell import Doorbell
from bus.produce import TrackingProducer
from bus.read_spec import BATCH_FETCH_WAIT_MS
from bus.topics import ensure_topics, retention
from kvstore.batch_store import BatchStore
from kvstore.bells import Bells, BellSubscription, Coalesced
from kvstore.connect import redis_client
from schemas.names import RedisKeys, batch_results_topic, batch_submit_topic, pool_topic
from schemas.settings import FrontendSettings
from schemas.status import WorkerStatus
from schemas.tenants import UsageRecord
from server.batch.coordinator import BatchCoordinator
from server.batch.intake import KafkaIntake
from server.batch.results import ResultCollector
from server.batch.rolling import BatchTopics
from server.logprobs import LogprobFormatter
from server.preprocess import Preprocessor

log = logging.getLogger("ferry.batch")


class BatchService:
    """The batch API's moving parts in one frontend."""

    def __init__(self, settings: FrontendSettings) -> None:
        self.settings = settings
        self.redis = redis_client(settings.redis, timeout_s=5.0)
        self.store = BatchStore(self.redis, RedisKeys(settings.redis_prefix))
        self.coordinator: BatchCoordinator | None = None
        self.collector: ResultCollector | None = None
        self.intake: KafkaIntake | None = None
        self.topics: BatchTopics | None = None

    @contextlib.asynccontextmanager
    async def running(
        self,
        pre: Preprocessor,
        fmt: LogprobFormatter,
        live: Callable[[], list[WorkerStatus]],
        on_usage: Callable[[UsageRecord], Awaitable[None]] | None = None,
    ) -> AsyncIterator[None]:
        """Run the coordinator, the results consumer and (unless switched off) the Kafka intake.

        `on_usage` gets the usage of each finished item of a tenant's batch (tenants' usage and quotas).
        """
        s = self.settings
        model = s.served_model_name
        fetch_wait_ms = max(s.kafka_fetch_wait_ms, BATCH_FETCH_WAIT_MS)
        # With --pool-roll-s, the pool and results topics are epochs created as they come (server/batch/rolling.py).
        unrolled = (
            {pool_topic(model): s.pool_partitions, batch_results_topic(model): 1}
            if s.pool_roll_s <= 0
            else {}
        )
        await ensure_topics(
            s.kafka,
            {**unrolled, batch_submit_topic(model): 1},
            retention(s.kafka_batch_retention_s, s.kafka_retention_bytes),
        )
        # A tracking producer forgets the pool epochs it no longer writes to: asking for a deleted one's
        # metadata by name would re-create it on the embedded broker (bus/produce.py).
        producer = TrackingProducer(bootstrap_servers=s.kafka, linger_ms=5, request_timeout_ms=10_000)
        topics = self.topics = BatchTopics(s, self.redis)
        coordinator = self.coordinator = BatchCoordinator(s, self.store, pre, live, topics)
        # Workers' pool consumers and the frontends' results readers sleep while the pool is idle, rung by
        # whoever wrote their records (kvstore/bells.py); without doorbells they poll as before.
        keys = RedisKeys(s.redis_prefix)
        pool_ring = Coalesced(Bells(self.redis, keys).publish_soon, keys.pool_bell(model)) if s.doorbell else None
        results_bell = Doorbell() if s.doorbell else None
        if pool_ring is not None:
            coordinator.on_items = pool_ring.ring
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(self.redis.aclose)
            # Registered before start: a start that fails (broker down) must still close the client.
            stack.push_async_callback(producer.stop)
            await producer.start()
            if s.pool_roll_s > 0:
                await topics.ensure_epochs()  # the current epochs exist before anyone reads or writes
                stack.push_async_callback(_cancelled, asyncio.create_task(topics.run(), name="batch-topics"))
                stack.push_async_callback(
                    _cancelled,
                    asyncio.create_task(producer.forget_idle_forever(), name="batch-topic-tracking"),
                )
            await stack.enter_async_context(coordinator.running(producer))
            self.collector = ResultCollector(
                s.kafka,
                model,
                self.store,
                fmt,
                producer,
                fetch_wait_ms,
                lambda _b: coordinator.kick(),
                on_usage,
                s.pool_roll_s,
                results_bell,
            )
            if results_bell is not None:
                subscription = BellSubscription(s.redis, keys.results_bell(model), "batch results", results_bell)
                subscription.start()
                stack.push_async_callback(subscription.stop)
            if pool_ring is not None:
                stack.callback(pool_ring.cancel)
            await self.collector.start()
            stack.push_async_callback(self.collector.stop)
            if s.batch_kafka_intake:
                self.intake = KafkaIntake(
                    s.kafka, model, self.store, coordinator.preparer, producer, live, fetch_wait_ms, topics
                )
                self.intake.on_items = None if pool_ring is None else pool_ring.ring
                await self.intake.start()
                stack.push_async_callback(self.intake.stop)
            yield


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel a background task and wait for it to end."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
