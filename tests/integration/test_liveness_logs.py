"""What the logs say when a worker drops out of routing: the frontend tells a worker whose registry entry expired
from one that left, and the worker says when its heartbeats were late because its event loop was held."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from tests.harness import Harness

pytestmark = pytest.mark.integration


async def test_the_frontend_tells_an_expired_worker_from_one_that_left(
    h: Harness, redis_url: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = await h.add_worker()
    wid = w.worker.settings.worker_id
    fe, _ = await h.add_frontend()
    keys = RedisKeys(prefix)
    redis = aioredis.from_url(redis_url)
    try:
        caplog.set_level(logging.WARNING, "ferry.frontend")
        # What expiry does: the status key is gone, the id still in the member set.
        await redis.delete(keys.worker(wid))
        await fe.svc.pool.refresh()
        assert f"worker {wid} left the registry: no heartbeat within its TTL" in caplog.messages
        caplog.clear()
        await w.worker.heartbeat.once()  # back, as its next heartbeat would make it
        await fe.svc.pool.refresh()
        assert wid in fe.svc.pool.workers
        await Registry(redis, keys).remove(wid)
        await fe.svc.pool.refresh()
        assert f"worker {wid} left the registry" in caplog.messages
        assert not any("TTL" in m for m in caplog.messages)
    finally:
        await redis.aclose()


async def test_a_worker_says_when_its_heartbeat_was_late(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "ferry.worker")
    w = await h.add_worker(heartbeat_interval_s=0.2)
    heartbeat = w.worker.heartbeat
    beats: asyncio.Queue[None] = asyncio.Queue()
    once = heartbeat.once

    async def counted() -> None:
        await once()
        beats.put_nowait(None)  # the test wakes once the heartbeat's next period has begun

    heartbeat.once = counted  # type: ignore[method-assign]
    await beats.get()
    time.sleep(0.6)  # noqa: ASYNC251 -- the loop held, as a blocking call or a starved process holds it
    async with asyncio.timeout(5):
        await beats.get()
    assert any("late: the event loop was blocked or starved" in m for m in caplog.messages)
    # Heartbeats on time say nothing.
    caplog.clear()
    async with asyncio.timeout(5):
        for _ in range(3):
            await beats.get()
    assert not any("late" in m for m in caplog.messages)
