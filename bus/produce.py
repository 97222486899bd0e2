"""Producing: a send that survives the broker's one-off UnknownError, and refreshing a producer's metadata."""

from __future__ import annotations

import asyncio
import contextlib

from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownError
from aiokafka.structs import RecordMetadata


async def send_and_wait(
    producer: AIOKafkaProducer, topic: str, value: bytes, key: bytes, partition: int = 0, attempts: int = 3
) -> RecordMetadata:
    """`producer.send_and_wait`, retrying the broker's UnknownError with fresh metadata.

    aiokafka calls UnknownError final, and the embedded broker answers it once for a topic that changed
    under the producer's metadata (docs/architecture.md, broker quirk "stale producer metadata").
    """
    for attempt in range(attempts):
        try:
            return await producer.send_and_wait(topic, value, key=key, partition=partition)
        except UnknownError:
            if attempt == attempts - 1:
                raise
            await producer.client.force_metadata_update()
    raise AssertionError("unreachable")


async def refresh_metadata(producer: AIOKafkaProducer, timeout_s: float = 5.0) -> None:
    """Fetch the producer's metadata anew (bounded); call when a reader found its log reset.

    Records written with stale metadata can be acknowledged and never seen (docs/architecture.md, broker
    quirk "stale producer metadata"); the frontend's delivery check is the safety net.
    """
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.client.force_metadata_update(), timeout_s)
