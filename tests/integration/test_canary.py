"""Canary health checks: a worker whose engine stops producing tokens while still passing check_health
leaves routing and its KV index entries, its streams move to another worker, and it exits with 1."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from tests.harness import Harness, sse_events
from workers.engine import EngineDead
from workers.sim import SimEngine

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
BODY = {
    "model": MODEL,
    # Long enough to fill blocks, so the worker has KV index entries to lose.
    "messages": [{"role": "user", "content": "Tell me about ferries. " * 40}],
    "max_tokens": 60,
    "ignore_eos": True,
    "stream": True,
    "seed": 3,
}


async def test_a_healthy_engine_answers_the_canary(h: Harness) -> None:
    w = await h.add_worker(canary_wait_s=0)  # no loop: the probe is called here
    await w.worker.canary.probe()
    assert w.worker.canary.sent == 1 and 0 < w.worker.canary.last_seconds < 5.0
    engine = w.worker.engine
    assert isinstance(engine, SimEngine)
    engine.hung = True
    w.worker.canary.timeout_s = 0.2
    with pytest.raises(EngineDead, match="canary"):
        await w.worker.canary.probe()
    engine.hung = False


async def test_hung_engine_is_caught_and_its_stream_moves(h: Harness, redis_url: str, prefix: str) -> None:
    # Speed 1 (real-time steps) on the victim, so the stream is still running when the engine hangs.
    victim = await h.add_worker(canary_wait_s=0.3, canary_timeout_s=0.5, speedup=1.0)
    fe, url = await h.add_frontend()
    engine = victim.worker.engine
    assert isinstance(engine, SimEngine)
    vid = victim.worker.settings.worker_id
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(prefix)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=BODY) as r:
                assert r.headers.get("x-ferry-worker") == vid, (r.status_code, await r.aread())
                events = []
                async with asyncio.timeout(30):  # never a hang
                    async for e in sse_events(r):
                        events.append(e)
                        if len(events) == 3:
                            assert await redis.exists(keys.worker_blocks(vid))
                            # Steps stop; check_health still passes. A healthy worker joins to take it over.
                            engine.hung = True
                            await engine.check_health()
                            await h.add_worker(canary_wait_s=0)
        assert await asyncio.wait_for(victim.task, 30) == 1  # exits non-zero, for its supervisor
        assert isinstance(victim.worker._fatal, Exception) and "canary" in str(victim.worker._fatal)
        live, _ = await Registry(redis, keys).snapshot()
        assert vid not in {w.worker_id for w in live}
        assert not await redis.exists(keys.worker_blocks(vid))  # its KV index entries are gone
        text = "".join(
            ch["delta"].get("content", "")
            for _, d in events
            if d != "[DONE]"
            for ch in json.loads(d).get("choices", [])
        )
        assert not any('"error"' in d for _, d in events), events[-3:]
        assert text
        finals = [json.loads(d)["choices"][0]["finish_reason"] for _, d in events if d != "[DONE]"]
        assert finals[-1] == "length"
        assert fe.metrics.worker_failures._value.get() >= 1  # the stream moved
    finally:
        await redis.aclose()
