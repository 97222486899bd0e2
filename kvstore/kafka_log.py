"""Kafka helpers that frontends and workers share: creating topics, and noticing a log that was reset.

A broker can come back without the log a consumer was reading: the embedded Tansu broker keeps
everything in memory, so a restart on the same address starts every topic again at offset 0, and a
Kafka cluster whose topic was deleted and recreated does the same. Tansu answers a fetch beyond the new
end with an empty batch rather than OFFSET_OUT_OF_RANGE, so `auto_offset_reset` never fires and the
consumer waits at its old position for records that will only arrive thousands of offsets lower.
`LogResetWatch` asks for the log end while a consumer is idle and starts it over from the beginning
when its position lies past that end, which a healthy log never allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

log = logging.getLogger("ferry.kafka")

# How long one offset commit may take before the caller reads on (its next commit covers the same).
COMMIT_TIMEOUT_S = 5.0


async def ensure_topics(bootstrap: str, topics: dict[str, int]) -> None:
    """Create each topic with its number of partitions unless it exists."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for topic, partitions in topics.items():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


async def commit_within(
    consumer: AIOKafkaConsumer,
    offsets: dict[TopicPartition, int] | None = None,
    timeout_s: float = COMMIT_TIMEOUT_S,
) -> None:
    """Commit offsets, raising TimeoutError after `timeout_s`; a caller cancelled meanwhile does not cut it short.

    aiokafka retries a commit for as long as the broker calls the error retriable, and a topic the broker
    forgot (an empty broker restarted on the same address) stays retriable forever, while the consumer
    that waits on it reads nothing.
    """
    task = asyncio.ensure_future(consumer.commit(offsets))
    try:
        await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except TimeoutError:
        task.cancel()
        raise


class LogResetWatch:
    """Rewinds a consumer's assigned partitions whose position lies beyond the log's end."""

    def __init__(
        self, consumer: AIOKafkaConsumer, name: str, every_s: float = 1.0, timeout_s: float = 2.0
    ) -> None:
        self._consumer = consumer
        self._name = name
        self._every_s = every_s
        self._timeout_s = timeout_s
        self._next = time.monotonic() + every_s

    async def check(self) -> list[TopicPartition]:
        """Call when a poll came back empty; returns the partitions it rewound (at most one check per period)."""
        now = time.monotonic()
        if now < self._next:
            return []
        self._next = now + self._every_s
        partitions = list(self._consumer.assignment())
        if not partitions:
            return []
        try:
            async with asyncio.timeout(self._timeout_s):
                ends = await self._consumer.end_offsets(partitions)
                positions = {tp: await self._consumer.position(tp) for tp in partitions}
        except (KafkaError, TimeoutError):
            # The broker is away: nothing to compare against yet. The next idle poll asks again.
            return []
        rewound = [tp for tp in partitions if positions[tp] > ends.get(tp, positions[tp])]
        for tp in rewound:
            log.warning(
                "%s: position %d is past the end (%d) of %s[%d]: the broker lost this log (restarted "
                "empty?); reading it again from the start",
                self._name,
                positions[tp],
                ends[tp],
                tp.topic,
                tp.partition,
            )
        if rewound:
            await self._consumer.seek_to_beginning(*rewound)
        return rewound
