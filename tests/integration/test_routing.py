"""Cache-aware routing with real workers, broker and Redis."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from kvstore.hashing import block_hashes, chain_seed
from kvstore.kv_index import KVIndex
from launch.services import free_port, start_redis
from schemas.names import RedisKeys
from tests.harness import Harness, harness, until, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(n)]


async def _complete(c: httpx.AsyncClient, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r


async def test_shared_prefix_goes_to_its_holder_and_is_reported_cached(h: Harness) -> None:
    for _ in range(4):
        await h.add_worker()
    _fe, url = await h.add_frontend()
    shared = _prompt(1, 640)  # 10 blocks of 64
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        first = await _complete(c, shared + _prompt(2, 50))
        holder = first.headers["x-ferry-worker"]
        assert first.headers["x-ferry-predicted-cached-blocks"] == "0"
        for tail in range(3, 8):
            r = await _complete(c, shared + _prompt(tail, 50))
            assert r.headers["x-ferry-worker"] == holder
            assert r.headers["x-ferry-predicted-cached-blocks"] == "10"
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 640
        other = await _complete(c, _prompt(99, 640))
        assert other.headers["x-ferry-predicted-cached-blocks"] == "0"


async def test_a_prefix_served_through_one_frontend_is_routed_to_its_holder_by_another(h: Harness) -> None:
    # The second frontend never saw the first request: only its copy of the KV log can tell it where the
    # prefix is (the default --kv-lookup mirror; nothing in flight or recently finished there).
    for _ in range(4):
        await h.add_worker()
    _fe1, url1 = await h.add_frontend()
    fe2, url2 = await h.add_frontend()
    shared = _prompt(11, 640)  # 10 blocks of 64
    chain = block_hashes(shared, 64, chain_seed(MODEL))
    async with httpx.AsyncClient(base_url=url1, timeout=30) as c1:
        holder = (await _complete(c1, shared + _prompt(12, 50))).headers["x-ferry-worker"]
    indexer = fe2.indexer
    assert indexer is not None

    async def mirrored() -> bool:
        return indexer.caught_up and indexer.overlaps(MODEL, chain).get(holder) == (10, 0)

    await until(mirrored, timeout_s=10)
    assert fe2.svc.router.recent is not None and not fe2.svc.router.recent.overlaps(MODEL, chain)
    async with httpx.AsyncClient(base_url=url2, timeout=30) as c2:
        r = await _complete(c2, shared + _prompt(13, 50))
    assert r.headers["x-ferry-worker"] == holder
    assert r.headers["x-ferry-predicted-cached-blocks"] == "10"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 640


async def test_two_frontends_share_load(h: Harness) -> None:
    a = await h.add_worker(speedup=1.0)
    b = await h.add_worker(speedup=1.0)
    fe1, url1 = await h.add_frontend(router_policy="least_loaded")
    fe2, url2 = await h.add_frontend(router_policy="least_loaded")
    async with (
        httpx.AsyncClient(base_url=url1, timeout=60) as c1,
        httpx.AsyncClient(base_url=url2, timeout=60) as c2,
    ):
        long_body = {
            "model": MODEL,
            "prompt": _prompt(5, 100),
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        async with c1.stream("POST", "/v1/completions", json=long_body) as r1:
            busy = r1.headers["x-ferry-worker"]
            assert fe1.svc.router.local[busy].sequences == 1
            # Frontend 1 publishes its load on its next refresh; frontend 2 reads it on its own.
            await fe1.svc.pool.refresh()
            await fe2.svc.pool.refresh()
            assert fe2.svc.router.remote[busy].sequences == 1
            for i in range(4):
                r = await _complete(c2, _prompt(10 + i, 100))
                assert r.headers["x-ferry-worker"] != busy
    assert {a.worker.settings.worker_id, b.worker.settings.worker_id} >= {busy}


async def test_dead_worker_leaves_the_index(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    child = await worker_process("victim", kafka, redis_url, prefix, model_path, "--speedup", "50")
    try:
        fe, url = await h.add_frontend()
        prompt = _prompt(3, 640)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await _complete(c, prompt)).headers["x-ferry-worker"] == "victim"
        index = KVIndex(aioredis.from_url(redis_url), RedisKeys(prefix))
        chain = block_hashes(prompt, 64, chain_seed(MODEL))
        assert (await index.overlaps(MODEL, chain)) == {"victim": 10}
        child.kill()
        async with asyncio.timeout(20):
            while "victim" in fe.svc.pool.workers:
                await fe.svc.pool.wait_changed()
        # The sweep was started in the background when the worker was seen dead.
        await asyncio.wait_for(asyncio.gather(*fe.background.tasks), 10)
        assert await index.overlaps(MODEL, chain) == {}
    finally:
        await child.stop()


async def test_redis_stopped_and_restarted(kafka: str, prefix: str, model_path: Path) -> None:
    port = free_port()
    redis_child, url = await start_redis(port)
    async with harness(kafka, url, prefix, model_path) as hh:
        w = await hh.add_worker()
        # The lookups in Redis are what notice the outage: the default reads the frontend's copy of the KV log.
        fe, base = await hh.add_frontend(kv_lookup="redis")
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            await _complete(c, _prompt(1, 200))
            await redis_child.stop()
            # Routing degrades to local load; requests still flow over Kafka.
            for i in range(3):
                await _complete(c, [*_prompt(1, 200), i + 5])
            assert not fe.svc.router.index_ok
            assert not await fe.svc.pool.tick()
            assert not fe.svc.pool.redis_ok
            assert w.worker.settings.worker_id in fe.svc.pool.workers  # the last known view is kept
            redis_child, _ = await start_redis(port)
            # Heartbeats re-register the worker in the empty Redis; the frontend picks it up again.
            async with asyncio.timeout(15):
                while not (await fe.svc.pool.tick() and w.worker.settings.worker_id in fe.svc.pool.workers):
                    await fe.svc.pool.wait_refreshed(1.0)
            # The index counts as back once its lookups have gone a second without an error.
            for _ in range(200):  # each a real request; bounded
                await _complete(c, _prompt(2, 200))
                if fe.svc.router.index_ok:
                    break
            assert fe.svc.router.index_ok
    await redis_child.stop()


async def test_lookup_reads_members_where_the_holders_change(redis_url: str, prefix: str) -> None:
    """The lookup skips member reads while a block's holders match the walkers: same-sized other sets still count."""
    from schemas.kv_events import BlockStored, KVEventBatch

    idx = KVIndex(aioredis.from_url(redis_url), RedisKeys(prefix))
    chain = block_hashes(_prompt(9, 64 * 6), 64, chain_seed("m"))
    await idx.apply("a", "m", KVEventBatch(0.0, [BlockStored(chain[:2])]))
    await idx.apply("b", "m", KVEventBatch(0.0, [BlockStored(chain[2:5])]))  # as many holders, other worker
    await idx.apply("c", "m", KVEventBatch(0.0, [BlockStored(chain)]))
    await idx.apply("d", "m", KVEventBatch(0.0, [BlockStored(chain[:4])]))
    assert await idx.overlaps("m", chain) == {"a": 2, "c": 6, "d": 4}
    await idx.clear_worker("c")
    assert await idx.overlaps("m", chain) == {"a": 2, "d": 4}
    await idx.clear_worker("d")
    await idx.apply("a", "m", KVEventBatch(0.0, [BlockStored(chain[2:3])]))  # a's chain continues
    assert await idx.overlaps("m", chain) == {"a": 3}
