"""Kafka helpers that frontends and workers share: creating topics, and noticing a log that was reset.

A broker can come back without the log a consumer was reading: the embedded Tansu broker keeps
everything in memory, so a restart on the same address starts every topic again at offset 0, and a
Kafka cluster whose topic was deleted and recreated does the same. Tansu answers a fetch beyond the new
end with an empty batch rather than OFFSET_OUT_OF_RANGE, so `auto_offset_reset` never fires and the
consumer waits at its old position for records that will only arrive thousands of offsets lower.
`LogResetWatch` compares an idle consumer's position with the high watermark its fetches report and
starts it over from the beginning when the position lies past that end, which a healthy log never allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError, UnknownError
from aiokafka.structs import RecordMetadata

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


async def delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Delete topics (those already gone are fine)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics(topics)
    finally:
        await admin.close()


async def send_and_wait(
    producer: AIOKafkaProducer, topic: str, value: bytes, key: bytes, partition: int = 0, attempts: int = 3
) -> RecordMetadata:
    """`producer.send_and_wait`, retrying the broker's UnknownError with fresh metadata.

    Tansu answers a produce with UnknownError once for a topic that changed under the producer's cached
    metadata (created anew after an empty restart); the next attempt goes through. aiokafka calls the
    error final, so without this the request behind it would fail.
    """
    for attempt in range(attempts):
        try:
            return await producer.send_and_wait(topic, value, key=key, partition=partition)
        except UnknownError:
            if attempt == attempts - 1:
                raise
            await producer.client.force_metadata_update()
    raise AssertionError("unreachable")


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


async def rewind_to_committed(consumer: AIOKafkaConsumer) -> None:
    """Move every assigned partition back to its group's last commit (the start where there is none).

    After a failure halfway through a fetched batch, the consumer's position is already past records that
    were not handled; without this they would be skipped until the next rebalance.
    """
    for tp in consumer.assignment():
        committed = await consumer.committed(tp)
        if committed is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, committed)


class LogResetWatch:
    """Rewinds a consumer's assigned partitions whose position lies beyond the log's end."""

    def __init__(self, consumer: AIOKafkaConsumer, name: str) -> None:
        self._consumer = consumer
        self._name = name

    async def check(self) -> list[TopicPartition]:
        """Call when a poll came back empty; returns the partitions it rewound.

        The end is the high watermark of the latest fetch response, which the idle consumer keeps getting.
        (Tansu's ListOffsets answer advances by one per produced batch, not per record, so it cannot be
        compared with a position.)
        """
        rewound = []
        for tp in self._consumer.assignment():
            end = self._consumer.highwater(tp)
            if end is None:
                continue
            try:
                # position() waits (up to the request timeout) while a position is being reset; a check
                # must never hold up the reader it watches.
                position = await asyncio.wait_for(self._consumer.position(tp), 0.05)
            except TimeoutError:
                continue
            if position > end:
                log.warning(
                    "%s: position %d is past the end (%d) of %s[%d]: the broker lost this log (restarted "
                    "empty?); reading it again from the start",
                    self._name, position, end, tp.topic, tp.partition,
                )
                rewound.append(tp)
        if rewound:
            await self._consumer.seek_to_beginning(*rewound)
        return rewound
