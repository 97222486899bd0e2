"""The planner's Kafka lag counts a worker's backlog over all of its request topics, rolled ones included."""

from __future__ import annotations

import uuid

import pytest
from aiokafka import AIOKafkaProducer

from bus.topics import ensure_topics
from planner.kafka_lag import KafkaLag
from schemas.names import request_topic

pytestmark = pytest.mark.integration


async def test_a_workers_lag_spans_its_rolled_request_topics(kafka: str) -> None:
    wid, other = f"w-{uuid.uuid4().hex[:6]}", f"x-{uuid.uuid4().hex[:6]}"
    waiting = {
        request_topic(wid): 1,
        request_topic(wid, 7): 2,
        request_topic(wid, 8): 3,
        request_topic(other, 7): 4,
    }
    await ensure_topics(kafka, dict.fromkeys(waiting, 1))
    producer = AIOKafkaProducer(bootstrap_servers=kafka)
    await producer.start()
    try:
        for topic, n in waiting.items():
            for _ in range(n):
                await producer.send_and_wait(topic, b"r", partition=0)
    finally:
        await producer.stop()
    lag = KafkaLag(kafka)
    await lag.start()
    try:
        assert await lag.workers([wid]) == 6  # nothing committed yet: every request is still waiting
        assert await lag.workers([wid, other]) == 10
    finally:
        await lag.close()
