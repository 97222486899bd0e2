"""Stopping an aiokafka consumer for good, also while the broker is away."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer


async def stop_consumer(consumer: AIOKafkaConsumer) -> None:
    """`consumer.stop()`, finishing the job where aiokafka's own stop is cut short.

    aiokafka 0.14's fetcher cancels its pending fetch tasks on close and then awaits them unguarded, so with
    the broker away (a fetch in its retry back-off) stop() raises CancelledError before it closes the
    client, whose metadata task then retries the dead broker for the life of the process.
    """
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise  # our caller is being cancelled: not aiokafka's doing
        await consumer._client.close()
