"""The pool and batch results topics rolled by the wall clock (`--pool-roll-s`): current epochs, deleting read ones.

Writers (the coordinator, the Kafka intake) send items to the current pool epoch, created before the first
send and an epoch ahead; workers send results to the current results epoch (workers/outbox.py). Workers and
frontends read every epoch by pattern. One frontend per model, holding a Redis lease, deletes an epoch once
it ended `EpochTopics.GRACE_S` ago and its consumer group has committed the end of every partition: an epoch
with items not yet run (a batch window is hours) stays until they are (docs/architecture.md, broker quirk
"no DeleteRecords, no retention"). Without rolling there is one topic each, bounded by Kafka's retention.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from aiokafka.errors import KafkaError
from redis.asyncio import Redis

from bus.epochs import EpochTopics, read_up
from bus.topics import delete_topics, ensure_topics, list_topics, retention
from kvstore.lease import lease_script
from schemas.names import RedisKeys, batch_results_group, batch_results_topic, pool_group, pool_topic
from schemas.settings import FrontendSettings

log = logging.getLogger("ferry.batch")


class BatchTopics:
    """Which pool and results topics are current; with rolling, a loop that creates and deletes epochs."""

    def __init__(self, settings: FrontendSettings, redis: Redis) -> None:
        s = settings
        self.kafka = s.kafka
        self.model = s.served_model_name
        self.partitions = s.pool_partitions
        self.pool = EpochTopics(functools.partial(pool_topic, self.model), s.pool_roll_s)
        self.results = EpochTopics(functools.partial(batch_results_topic, self.model), s.pool_roll_s)
        self.configs = retention(s.kafka_batch_retention_s, s.kafka_retention_bytes)
        self._redis = redis
        self._lease_key = RedisKeys(s.redis_prefix).batch_roll_lease(self.model)
        self._lease = lease_script(redis)
        self._owner = s.frontend_id
        self._created: set[str] = set()  # topics this frontend created (or found) already
        self._create = asyncio.Lock()
        # A pass every quarter of an epoch, at most every 30 s and at least every 200 ms.
        self.period_s = min(30.0, max(0.2, s.pool_roll_s / 4))
        self.lease_ms = int(3 * self.period_s * 1000) + 1000

    async def pool_now(self) -> str:
        """The pool topic to send an item to now (created before the first send)."""
        topic = self.pool.current()
        if topic not in self._created:
            await self._ensure({topic: self.partitions, self.results.current(): 1})
        return topic

    async def _ensure(self, topics: dict[str, int]) -> None:
        async with self._create:
            todo = {t: n for t, n in topics.items() if t not in self._created}
            if todo:
                await ensure_topics(self.kafka, todo, self.configs)
                self._created.update(todo)
                if len(self._created) > 64:  # only the latest epochs matter
                    self._created = set(todo)

    async def run(self) -> None:
        """With rolling: every `period_s`, create the current and next epochs; the lease holder deletes read ones."""
        if not self.pool.rolled:
            return
        while True:
            try:
                await self.tick()
            except Exception as exc:  # broker or Redis trouble: the next pass tries again
                log.warning("batch topics: %r; trying again", exc)
            await asyncio.sleep(self.period_s)  # the wall clock sets no event

    async def tick(self) -> None:
        """One pass: create the current and next epochs; delete read past ones if this frontend holds the lease."""
        await self.ensure_epochs()
        if not await self._lease(keys=[self._lease_key], args=[self._owner, self.lease_ms]):
            return
        listed = await list_topics(self.kafka)  # every topic: none asked for by name
        await self._prune(listed, self.pool, pool_group(self.model))
        await self._prune(listed, self.results, batch_results_group(self.model))

    async def ensure_epochs(self) -> None:
        """Create the current epoch of both topics, and the next one once the grace of the last has passed."""
        topics = {self.pool.current(): self.partitions, self.results.current(): 1}
        if self.pool.ahead_due():
            topics.update({self.pool.ahead(): self.partitions, self.results.ahead(): 1})
        await self._ensure(topics)

    async def _prune(self, listed: list[str], family: EpochTopics, group: str) -> None:
        over = sorted((t for t in listed if family.over(t)), key=lambda t: (len(t), t))
        done = await read_up(self.kafka, group, over)
        if not done:
            return
        try:
            await delete_topics(self.kafka, done)
        except KafkaError as exc:
            log.warning("could not delete read batch topics %s: %r", done, exc)
            return
        log.info("batch topics: deleted read epochs %s", done)
