"""Overload: far more concurrent requests than a frontend admits get clear refusals, nothing else.

The frontend runs as a child process (`ferry frontend`, so its memory is its own) with a small
`--max-concurrent-requests`, in front of one sim worker that is slow enough for requests to pile up.
Every request either completes or is refused with 503 (or 429) and `Retry-After`; memory measured
before and after repeated bursts stays within a stated bound.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.services import Child
from tests.harness import frontend_process, sse_events, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 12
BURST = 300
BURSTS = 2
MAX_TOKENS = 16
# What the frontend may grow by across the measured bursts, once warm (a leak of one kilobyte per
# request would already show as ~0.9 MiB here; the bound leaves room for allocator noise).
RSS_GROWTH_BOUND_MIB = 24.0


def rss_mib(pid: int) -> float:
    """Resident set size of `pid` in MiB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest_asyncio.fixture
async def overloaded(
    kafka: str, redis_url: str, prefix: str, model_path: Path
) -> AsyncIterator[tuple[Child, str]]:
    # One slow worker (real-time steps / 4, at most 8 sequences a step) is the capacity to overrun.
    worker = await worker_process(
        f"w-{uuid.uuid4().hex[:6]}",
        kafka,
        redis_url,
        prefix,
        model_path,
        "--speedup",
        "4",
        "--max-num-seqs",
        "8",
    )
    try:
        front, url = await frontend_process(
            kafka, redis_url, prefix, model_path, "--max-concurrent-requests", str(LIMIT)
        )
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                for _ in range(200):
                    if (await c.get("/ready")).status_code == 200:
                        break
                    await asyncio.sleep(0.1)  # the frontend's registry view refreshes on a timer
            yield front, url
        finally:
            # Not out within 10 s: its last lines say which shutdown step it was waiting on.
            assert await front.stop() == 0, "\n".join(front.tail)
    finally:
        await worker.stop()


def body(i: int, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"request {i}: tell me something"}],
        "max_tokens": MAX_TOKENS,
        "stream": stream,
        "ignore_eos": True,
    }


async def one(c: httpx.AsyncClient, i: int) -> str:
    """Send one request; its outcome: `completed`, `refused`, or a description of what went wrong."""
    stream = i % 2 == 0
    try:
        if not stream:
            r = await c.post("/v1/chat/completions", json=body(i, False))
            if r.status_code == 200:
                ok = r.json()["usage"]["completion_tokens"] == MAX_TOKENS
                return "completed" if ok else f"short answer {r.text[:200]}"
            return refusal(r)
        async with c.stream("POST", "/v1/chat/completions", json=body(i, True)) as r:
            if r.status_code != 200:
                await r.aread()
                return refusal(r)
            events = [d async for _, d in sse_events(r)]
        if events[-1] != "[DONE]" or any('"error"' in d for d in events):
            return f"stream ended badly: {events[-3:]}"
        finals = [json.loads(d)["choices"][0]["finish_reason"] for d in events[:-1]]
        return "completed" if finals[-1] == "length" else f"stream finish {finals[-1]}"
    except httpx.HTTPError as exc:
        return f"transport error {exc!r}"


def refusal(r: httpx.Response) -> str:
    """`refused` for a 503/429 with Retry-After and an OpenAI error body; else what it was."""
    if r.status_code in (429, 503) and int(r.headers.get("retry-after", "0")) >= 1:
        err = r.json()["error"]
        if err["code"] in ("overloaded", "workers_busy") and err["type"] in (
            "service_unavailable_error",
            "rate_limit_error",
        ):
            return "refused"
    return f"status {r.status_code}: {r.text[:200]}"


async def burst(url: str, n: int) -> Counter[str]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        return Counter(await asyncio.gather(*(one(c, i) for i in range(n))))


async def inflight(url: str) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        text = (await c.get("/metrics")).text
    return next(
        float(line.split()[1]) for line in text.splitlines() if line.startswith("ferry_requests_inflight ")
    )


async def test_open_streams_count_against_the_limit(overloaded: tuple[Child, str]) -> None:
    _front, url = overloaded
    limits = httpx.Limits(max_connections=LIMIT + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        long = {**body(0, True), "max_tokens": 400}
        streams = [c.stream("POST", "/v1/chat/completions", json=long) for _ in range(LIMIT)]
        opened = [await s.__aenter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            # Every place is taken by a stream whose handler has long returned: the next one is refused.
            for stream in (False, True):
                r = await c.post("/v1/chat/completions", json=body(1, stream))
                assert refusal(r) == "refused", (r.status_code, r.text)
        finally:
            for s in streams:
                await s.__aexit__(None, None, None)
        # The places come back once the streams are gone (disconnects included).
        for _ in range(100):
            if await inflight(url) == 0:
                break
            await asyncio.sleep(0.1)  # the cancelled streams unwind asynchronously
        assert await inflight(url) == 0
        assert (await c.post("/v1/chat/completions", json=body(2, False))).status_code == 200


async def test_burst_far_over_capacity_only_refuses_and_memory_stays_bounded(
    overloaded: tuple[Child, str],
) -> None:
    front, url = overloaded
    warm = await burst(url, BURST)  # first burst: imports, caches and pools reach their working size
    before = rss_mib(front.proc.pid)
    outcomes = Counter[str]()
    for _ in range(BURSTS):
        outcomes += await burst(url, BURST)
    after = rss_mib(front.proc.pid)
    total = warm + outcomes
    assert set(total) <= {"completed", "refused"}, total
    assert total["refused"] > 0 and total["completed"] > 0, total  # capacity really was exceeded
    assert await inflight(url) == 0
    print(f"\nRSS before {before:.1f} MiB, after {BURSTS} bursts of {BURST}: {after:.1f} MiB; {dict(total)}")
    assert after - before < RSS_GROWTH_BOUND_MIB, (before, after)
