"""Offset commits of consumer-group members: bounded in time, and rewinding to the last one."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer, TopicPartition

# How long one offset commit may take before the caller reads on (its next commit covers the same).
COMMIT_TIMEOUT_S = 5.0


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
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(task)
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
