"""The planner's Kafka lag counts a worker's backlog over all of its request topics, rolled ones included."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bus.topics import ensure_topics
from planner.kafka_lag import KafkaLag
from schemas.names import pool_group, pool_topic, request_topic

pytestmark = pytest.mark.integration


async def _fill(kafka: str, waiting: dict[str, int], partitions: int) -> None:
    """Create each topic and write its count of records to its last partition."""
    await ensure_topics(kafka, dict.fromkeys(waiting, partitions))
    producer = AIOKafkaProducer(bootstrap_servers=kafka)
    await producer.start()
    try:
        for topic, n in waiting.items():
            for _ in range(n):
                await producer.send_and_wait(topic, b"r", partition=partitions - 1)
    finally:
        await producer.stop()


async def test_a_workers_lag_spans_its_rolled_request_topics(kafka: str) -> None:
    wid, other = f"w-{uuid.uuid4().hex[:6]}", f"x-{uuid.uuid4().hex[:6]}"
    waiting = {
        request_topic(wid): 1,
        request_topic(wid, 7): 2,
        request_topic(wid, 8): 3,
        request_topic(other, 7): 4,
    }
    await _fill(kafka, waiting, partitions=1)
    lag = KafkaLag(kafka)
    await lag.start()
    try:
        assert await lag.workers([wid]) == 6  # nothing committed yet: every request is still waiting
        assert await lag.workers([wid, other]) == 10
    finally:
        await lag.close()


async def test_the_pool_lag_spans_every_pool_epoch_and_counts_commits(kafka: str) -> None:
    model = f"m-{uuid.uuid4().hex[:6]}"
    waiting = {
        pool_topic(model): 1,
        pool_topic(model, 7): 2,
        pool_topic(model, 8): 3,
        pool_topic(f"{model}x", 7): 4,
    }
    await _fill(kafka, waiting, partitions=2)
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, group_id=pool_group(model), enable_auto_commit=False)
    await consumer.start()
    try:
        done = TopicPartition(pool_topic(model, 7), 1)
        consumer.assign([done])
        await consumer.commit({done: 2})  # that epoch's items are done
    finally:
        await consumer.stop()
    lag = KafkaLag(kafka)
    await lag.start()
    try:
        assert await lag.pool(model) == (4, 2)  # the other model's epoch is not counted
    finally:
        await lag.close()
