"""An engine that dies (its step loop gone, as when vLLM's EngineCore process exits) takes its worker out as a
dead worker: the worker leaves routing and exits with 1, its open streams move to another worker and finish
there, and no client sees an `engine_dead` error."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from server.frontend import Frontend
from tests.harness import Harness, sse_events, until
from workers.engine import EngineDead
from workers.sim import SimEngine

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about ferries. " * 10}],
    "max_tokens": 60,
    "ignore_eos": True,
    "stream": True,
    "seed": 3,
}


async def test_a_dead_engines_stream_finishes_on_another_worker(
    h: Harness, redis_url: str, prefix: str
) -> None:
    # Speed 1 (real-time steps) on the victim, so the stream is still running when its engine dies. No
    # canary: the death itself must be what takes the worker out.
    # Slow heartbeats: on a loaded host a missed one must not pass for the death (leaving is immediate).
    victim = await h.add_worker(canary_wait_s=0, speedup=1.0, heartbeat_interval_s=2.0)
    fe, url = await h.add_frontend()
    await until(lambda: _sees(fe, victim.worker.settings.worker_id), 10)
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
                            # A healthy worker joins to take the stream over; then the engine dies.
                            rescuer = await h.add_worker(canary_wait_s=0, heartbeat_interval_s=2.0)
                            engine.crash = True
        assert await asyncio.wait_for(victim.task, 30) == 1  # exits non-zero, for its supervisor
        assert isinstance(victim.worker._fatal, EngineDead) and "crash" in str(victim.worker._fatal)
        live, _ = await Registry(redis, keys).snapshot()
        assert vid not in {w.worker_id for w in live}
        assert not any('"error"' in d for _, d in events), events[-3:]
        chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
        text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c.get("choices", []))
        assert text and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert fe.metrics.migrations.labels("worker_died", "moved")._value.get() == 1
        # The rest of the stream was generated on the rescuer.
        assert rescuer.worker.metrics.generated_tokens._value.get() > 0
    finally:
        await redis.aclose()


async def _sees(fe: Frontend, worker_id: str) -> bool:
    await fe.svc.pool.refresh()
    return worker_id in fe.svc.pool.workers
