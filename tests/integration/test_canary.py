"""An engine that stops producing tokens (caught by the canary, though it passes check_health) or dies takes
its worker out as a dead worker: it leaves routing and its KV index entries, its streams move to another
worker and finish there with no error, and it exits with 1."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from kvstore.registry import Registry
from schemas.names import RedisKeys
from server.frontend import Frontend
from tests.harness import Harness, stream_with_fault, until
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


async def _gone(redis: aioredis.Redis, keys: RedisKeys, worker_id: str) -> bool:
    live, _ = await Registry(redis, keys).snapshot()
    return worker_id not in {w.worker_id for w in live}


async def test_hung_engine_is_caught_and_its_stream_moves(h: Harness, redis_url: str, prefix: str) -> None:
    # Speed 1 (real-time steps) on the victim, so the stream is still running when the engine hangs.
    victim = await h.add_worker(canary_wait_s=0.3, canary_timeout_s=0.5, speedup=1.0)
    fe, url = await h.add_frontend()
    engine = victim.worker.engine
    assert isinstance(engine, SimEngine)
    vid = victim.worker.settings.worker_id
    redis = aioredis.from_url(redis_url)
    keys = RedisKeys(prefix)

    async def hang() -> None:
        assert await redis.exists(keys.worker_blocks(vid))
        # Steps stop; check_health still passes. A healthy worker joins to take it over.
        engine.hung = True
        await engine.check_health()
        await h.add_worker(canary_wait_s=0)

    try:
        await stream_with_fault(url, BODY, vid, hang)
        assert await asyncio.wait_for(victim.task, 30) == 1  # exits non-zero, for its supervisor
        assert isinstance(victim.worker._fatal, Exception) and "canary" in str(victim.worker._fatal)
        assert await _gone(redis, keys, vid)
        assert not await redis.exists(keys.worker_blocks(vid))  # its KV index entries are gone
        assert fe.metrics.worker_failures._value.get() >= 1  # the stream moved
    finally:
        await redis.aclose()


async def test_a_dead_engines_stream_finishes_on_another_worker(h: Harness, redis_url: str, prefix: str) -> None:
    """A dead engine (its step loop gone, as when vLLM's EngineCore exits) takes its worker out as a dead
    worker: no client sees an `engine_dead` error, the stream finishes on another worker, moved by the worker's last
    word for it (schemas/kafka.py, ENGINE_DEAD)."""
    # No canary: the death itself must be what takes the worker out. Slow heartbeats: on a loaded host a
    # missed one must not pass for the death (leaving is immediate).
    victim = await h.add_worker(canary_wait_s=0, speedup=1.0, heartbeat_interval_s=2.0)
    fe, url = await h.add_frontend()
    await until(lambda: _sees(fe, victim.worker.settings.worker_id), 10)
    engine = victim.worker.engine
    assert isinstance(engine, SimEngine)
    vid = victim.worker.settings.worker_id
    redis = aioredis.from_url(redis_url)
    rescuers = []

    async def crash() -> None:
        # A healthy worker joins to take the stream over; then the engine dies.
        rescuers.append(await h.add_worker(canary_wait_s=0, heartbeat_interval_s=2.0))
        engine.crash = True

    try:
        await stream_with_fault(url, BODY, vid, crash)
        assert await asyncio.wait_for(victim.task, 30) == 1  # exits non-zero, for its supervisor
        assert isinstance(victim.worker._fatal, EngineDead) and "crash" in str(victim.worker._fatal)
        assert await _gone(redis, RedisKeys(prefix), vid)
        assert fe.metrics.migrations.labels("engine_died", "moved")._value.get() == 1
        # The rest of the stream was generated on the rescuer.
        assert rescuers[0].worker.metrics.generated_tokens._value.get() > 0
    finally:
        await redis.aclose()


async def _sees(fe: Frontend, worker_id: str) -> bool:
    await fe.svc.pool.refresh()
    return worker_id in fe.svc.pool.workers
