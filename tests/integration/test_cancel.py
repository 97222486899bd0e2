"""Clients that leave, streaming or not: their sequences are aborted in the engine and nothing leaks.

The worker is a real process; what it holds is read from its registry status and its /metrics, as an
operator would.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from kvstore.registry import Registry
from schemas.names import RedisKeys
from schemas.status import WorkerStatus
from tests.harness import Harness, sse_events, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def chat(i: int, max_tokens: int, **kw: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Request number {i}"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **kw,
    }


async def status_until(
    redis_url: str, prefix: str, worker_id: str, ok: object, wait_s: float = 20
) -> WorkerStatus:
    """The worker's registry status once `ok(status)` holds (it changes with each heartbeat)."""
    redis = aioredis.from_url(redis_url)
    try:
        registry = Registry(redis, RedisKeys(prefix))
        deadline = time.monotonic() + wait_s
        last: WorkerStatus | None = None
        while time.monotonic() < deadline:
            live, _ = await registry.snapshot()
            for w in live:
                if w.worker_id == worker_id:
                    last = w
                    if ok(w):  # type: ignore[operator]
                        return w
            await asyncio.sleep(0.05)  # heartbeat-driven state: poll it
        raise AssertionError(f"worker status never satisfied the condition; last: {last}")
    finally:
        await redis.aclose()


async def outcomes(metrics_url: str) -> dict[str, float]:
    """ferry_worker_requests_total by outcome, from the worker's /metrics."""
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(metrics_url)).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "ferry_worker_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["outcome"]] = sample.value
    return out


async def test_cancelling_n_of_m_leaves_nothing_running_and_no_blocks_held(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    wid = f"cancel-{prefix.rstrip(':')}"
    # Real-time steps: a 2000-token answer is still running when its client leaves.
    child = await worker_process(wid, kafka, redis_url, prefix, model_path, "--speedup", "1")
    try:
        _fe, url = await h.add_frontend()
        baseline = await status_until(redis_url, prefix, wid, lambda w: True)
        assert baseline.running == 0
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:

            async def stream(i: int, max_tokens: int, drop_after: int | None) -> int:
                """Events read before leaving when `drop_after`; else the completion tokens of a whole stream."""
                body = chat(i, max_tokens, stream=True, stream_options={"include_usage": True})
                n, tokens = 0, -1
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    async for _id, data in sse_events(r):
                        n += 1
                        if n == drop_after:
                            return n  # leaving the block closes the connection mid-stream
                        if data == "[DONE]":
                            return tokens
                        usage = json.loads(data).get("usage")
                        if usage:
                            tokens = usage["completion_tokens"]
                return -1  # ended without [DONE]

            async def whole(i: int, max_tokens: int) -> httpx.Response:
                return await c.post("/v1/chat/completions", json=chat(i, max_tokens))

            # M = 8 concurrent requests; N = 5 of them are abandoned mid-generation.
            kept_streams = [asyncio.create_task(stream(i, 20, None)) for i in range(2)]
            kept_whole = [asyncio.create_task(whole(i, 20)) for i in range(2, 3)]
            dropped_streams = [asyncio.create_task(stream(i, 2000, 3)) for i in range(3, 6)]
            dropped_whole = [asyncio.create_task(whole(i, 2000)) for i in range(6, 8)]
            for r in await asyncio.gather(*kept_whole):
                assert r.status_code == 200
                assert r.json()["usage"]["completion_tokens"] == 20
            assert await asyncio.gather(*kept_streams) == [20, 20]
            assert await asyncio.gather(*dropped_streams) == [3, 3, 3]
            # The non-streaming clients give up while their answers are being generated: once the dropped
            # streams are aborted and the kept requests done, the two long ones are what runs.
            async with asyncio.timeout(20):
                for _ in iter(int, 1):  # until the counts are there (polling: a remote process's state)
                    if await outcomes(baseline.metrics_url) == {"aborted": 3.0, "finished": 3.0}:
                        break
                    await asyncio.sleep(0.05)
            await status_until(redis_url, prefix, wid, lambda w: w.running == 2)
            assert not any(t.done() for t in dropped_whole)
            for t in dropped_whole:
                t.cancel()
            await asyncio.gather(*dropped_whole, return_exceptions=True)

        # Nothing unfinished, no blocks held.
        after = await status_until(
            redis_url,
            prefix,
            wid,
            lambda w: w.running == 0 and w.waiting == 0 and w.kv_usage == baseline.kv_usage,
        )
        assert after.kv_usage == baseline.kv_usage
        counts = await outcomes(after.metrics_url)
        assert counts == {"aborted": 5.0, "finished": 3.0}, counts
    finally:
        await child.stop()
