"""Topic admin: creating and deleting topics."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError


@contextlib.asynccontextmanager
async def _admin(bootstrap: str) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def ensure_topics(bootstrap: str, topics: dict[str, int]) -> None:
    """Create each topic with its number of partitions unless it exists."""
    async with _admin(bootstrap) as admin:
        for topic, partitions in topics.items():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])


async def delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Delete topics (those already gone are fine)."""
    async with _admin(bootstrap) as admin:
        await admin.delete_topics(topics)
