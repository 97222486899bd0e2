"""Stopping an aiokafka consumer for good, also while the broker is away or a group join cannot end."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from aiokafka import AIOKafkaConsumer

log = logging.getLogger("ferry.kafka")


async def stop_consumer(consumer: AIOKafkaConsumer, join_wait_s: float | None = None) -> None:
    """`consumer.stop()`, finishing the job where aiokafka's own stop is cut short.

    aiokafka 0.14's fetcher cancels its pending fetch tasks on close and then awaits them unguarded, so with
    the broker away (a fetch in its retry back-off) stop() raises CancelledError before it closes the
    client, whose metadata task then retries the dead broker for the life of the process.

    A group member's stop() first waits for its coordination task, which may be inside a group join: the
    broker answers a JoinGroup only once every member it counts has rejoined or been dropped, so the stop
    can wait for as long as another member is busy or stuck (each JoinGroup up to the 40 s request timeout,
    and again). With `join_wait_s`, a join still under way after that long is given up (the caller
    commits before it stops; a join gives nothing to commit): the broker drops the member after its
    session timeout, as it would a member that died.
    """
    routine: asyncio.Task[Any] | None = None
    if join_wait_s is not None:
        routine = getattr(getattr(consumer, "_coordinator", None), "_coordination_task", None)
    stopping = asyncio.ensure_future(consumer.stop())
    gave_up = False
    if routine is not None and not routine.done():
        await asyncio.wait([routine], timeout=join_wait_s)
        if not routine.done():
            log.warning("consumer group join did not end within %.1fs of stopping; leaving it", join_wait_s)
            gave_up = True
            routine.cancel()  # stop() awaits it, so it raises CancelledError and is finished below
    try:
        await stopping
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise  # our caller is being cancelled: not aiokafka's doing
        if gave_up:
            # stop() ended before stopping these (they may be running when a rebalance cut the join).
            coordinator = consumer._coordinator
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await coordinator._stop_heartbeat_task()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await consumer._fetcher.close()
        await consumer._client.close()
