"""Sleep, wake-up and prefix-cache reset through the frontend's admin routes (simulated workers, which free
nothing when asleep): a sleeping worker leaves routing first and its KV index entries go; wake-up brings it
back."""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from tests.harness import Harness

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
# Long enough to fill KV blocks, so the worker has index entries.
CHAT = {
    "model": MODEL,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "Tell me about ferries. " * 40}],
}


async def test_sleep_wake_and_reset(h: Harness, redis_url: str, prefix: str) -> None:
    a = await h.add_worker(canary_wait_s=0.05)  # canaries must not run against a sleeping engine
    b = await h.add_worker()
    _fe, url = await h.add_frontend()
    aid, bid = a.worker.settings.worker_id, b.worker.settings.worker_id
    keys = RedisKeys(prefix)
    redis = aioredis.from_url(redis_url)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            served = {
                (await c.post("/v1/chat/completions", json=CHAT)).headers["x-ferry-worker"] for _ in range(4)
            }
            assert aid in served or await c.post("/v1/chat/completions", json=CHAT)
            await a.worker.heartbeat.once()
            r = await c.post("/v1/admin/sleep", params={"worker_id": aid, "level": 1})
            assert r.status_code == 200 and r.json() == {"op": "sleep", "workers": [aid]}
            assert a.worker.ops.sleeping
            assert not await redis.exists(keys.worker_blocks(aid))  # its index entries are gone
            status = {w.worker_id: w for w in (await Registry(redis, keys).snapshot())[0]}
            assert status[aid].draining and not status[bid].draining
            assert (await c.get("/v1/admin/is_sleeping")).json() == {"workers": {aid: True, bid: False}}
            sent_before = a.worker.canary.sent
            for _ in range(4):  # every request goes to the awake worker, even the one with the cached prefix
                r = await c.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200 and r.headers["x-ferry-worker"] == bid
            assert a.worker.canary.sent == sent_before
            assert (await c.post("/v1/admin/sleep", params={"level": 3})).status_code == 400
            r = await c.post("/v1/admin/wake_up", params={"worker_id": aid})
            assert r.status_code == 200 and not a.worker.ops.sleeping
            assert (await c.get("/v1/admin/is_sleeping")).json() == {"workers": {aid: False, bid: False}}
            assert await redis.exists(keys.worker_blocks(bid))
            # On b, whose canary (every 10 s) is not holding blocks just now: a held block makes it a 503.
            r = await c.post("/v1/admin/reset_prefix_cache", params={"worker_id": bid})
            assert r.status_code == 200 and r.json()["workers"] == [bid]
            assert not await redis.exists(keys.worker_blocks(bid))
            assert (await c.post("/v1/admin/wake_up", params={"worker_id": "nobody"})).status_code == 404
    finally:
        await redis.aclose()
