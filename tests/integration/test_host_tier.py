"""The host KV tier end to end: a sim worker with a small device cache, the real broker and Redis."""

from __future__ import annotations

import httpx
import pytest
import redis.asyncio as aioredis

from kvstore.hashing import block_hashes, chain_seed
from kvstore.kv_index import KVIndex
from schemas.names import RedisKeys
from tests.harness import Harness, until

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 40000 + 100 for i in range(n)]


async def _complete(c: httpx.AsyncClient, prompt: list[int]) -> httpx.Response:
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r


async def test_prefix_evicted_to_host_is_routed_to_its_holder_and_served_cached(
    h: Harness, redis_url: str, prefix: str
) -> None:
    # 16 device blocks of 64 tokens each, and a host tier of 64 blocks.
    for _ in range(2):
        await h.add_worker(num_blocks=16, max_model_len=1024, num_host_blocks=64, block_size=64)
    fe, url = await h.add_frontend()
    shared = _prompt(1, 640)  # 10 blocks
    chain = block_hashes(shared, 64, chain_seed(MODEL))
    index = KVIndex(aioredis.from_url(redis_url), RedisKeys(prefix))
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        holder = (await _complete(c, shared + _prompt(2, 50))).headers["x-ferry-worker"]
        # Two 900-token prompts sharing only the first block follow it there (15 blocks each of the 16):
        # they push the prefix's other 9 blocks out to the host tier.
        for filler in (3, 4):
            r = await _complete(c, shared[:64] + _prompt(filler, 836))
            assert r.headers["x-ferry-worker"] == holder

        async def on_host() -> bool:
            return (await index.tiered_overlaps(MODEL, chain)).get(holder, (0, 0)) == (10, 9)

        await until(on_host, timeout_s=10)
        recent = fe.svc.router.recent
        assert recent is not None

        # The router also counts a prompt that just finished on a worker as held on its device there, for
        # RECENT_S: wait until only the index speaks.
        async def forgotten() -> bool:
            return not recent.overlaps(MODEL, chain)

        await until(forgotten, timeout_s=10)
        r = await _complete(c, shared + _prompt(5, 50))
    assert r.headers["x-ferry-worker"] == holder
    assert r.headers["x-ferry-predicted-cached-blocks"] == "10"
    assert r.headers["x-ferry-predicted-host-blocks"] == "9"
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 640
