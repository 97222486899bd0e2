"""The worker registry against a real Redis."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from schemas.status import WorkerStatus

pytestmark = pytest.mark.integration


def _status(wid: str, **kw: object) -> WorkerStatus:
    now = time.time()
    return WorkerStatus(
        worker_id=wid, model="m", engine="sim", block_size=64, total_blocks=100, max_model_len=2048,
        started_at=now, heartbeat_at=now, **kw,  # type: ignore[arg-type]
    )


async def test_publish_snapshot_remove(redis_url: str, prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    reg = Registry(client, RedisKeys(prefix))
    await reg.publish(_status("a", running=3), ttl_s=5)
    await reg.publish(_status("b", draining=True), ttl_s=5)
    live, dead = await reg.snapshot()
    assert {w.worker_id: w.running for w in live} == {"a": 3, "b": 0}
    assert [w.draining for w in sorted(live, key=lambda w: w.worker_id)] == [False, True]
    assert dead == []
    await reg.remove("a")
    live, dead = await reg.snapshot()
    assert [w.worker_id for w in live] == ["b"]
    await client.aclose()


async def test_status_key_carries_ttl_and_expired_worker_is_reaped(redis_url: str, prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    keys = RedisKeys(prefix)
    reg = Registry(client, keys)
    await reg.publish(_status("a"), ttl_s=3)
    pttl = await client.pttl(keys.worker("a"))
    assert 0 < pttl <= 3000
    # What expiry does: the status key disappears while the id stays in the member set.
    await client.delete(keys.worker("a"))
    live, dead = await reg.snapshot()
    assert live == [] and dead == ["a"]
    assert await client.smembers(keys.workers()) == set()
    # Reaped once: the next reader does not report it again.
    assert await reg.snapshot() == ([], [])
    await client.aclose()


async def test_undecodable_status_is_ignored(redis_url: str, prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    keys = RedisKeys(prefix)
    await client.set(keys.worker("x"), b"\xc1garbage")
    await client.sadd(keys.workers(), "x")
    live, dead = await Registry(client, keys).snapshot()
    assert live == [] and dead == []
    await client.aclose()
