"""Every PromQL expression of the Grafana dashboard, run against a real Prometheus scraping a live stack.

The stack is `ferry up`'s, as separate processes: two sim workers and a frontend on the real broker and
Redis, and Prometheus (`make prometheus`) finding them through /discovery/prometheus. Traffic makes every
panel's series exist: streams with a shared prefix (cache hits, routing), a burst beyond the busy threshold
(busy waits), a refused request (errors), a small batch (pool items) and a worker killed mid-stream (a
migration). A query that errors or returns no series fails the test. The planner's panels are the one
exception, and only while no `ferry_planner_*` series exists at all: no planner runs in this stack.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from launch.dashboard import OUT
from launch.monitor import start_monitor
from launch.services import start_broker
from tests.harness import frontend_process, sse_events, until, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = "You are a meticulous geography tutor who answers briefly. " * 12


def expressions() -> list[tuple[str, str, bool]]:
    """(panel title, expression, optional) of every target, with the dashboard's variables filled in."""
    d = json.loads(OUT.read_text())
    out = []
    for p in d["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            out.append((p["title"], expr, p["title"] in ("Workers: desired vs live", "Planner decisions")))
    return out


async def _stream(c: httpx.AsyncClient, question: str, max_tokens: int = 30, system: str = SYSTEM) -> None:
    messages = [{"role": "system", "content": system}] if system else []
    payload = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
               "messages": [*messages, {"role": "user", "content": question}]}  # fmt: skip
    async with c.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for _ in sse_events(r):
            pass


async def _batch(url: str) -> None:
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    lines = [json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": 4,
                                  "messages": [{"role": "user", "content": f"Batch question {i}"}]}})
             for i in range(4)]  # fmt: skip
    f = await client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    async def done() -> bool:
        return (await client.batches.retrieve(batch.id)).status in ("completed", "failed", "expired")

    await until(done, 120, 0.2)


async def _waiting_in_frontend(c: httpx.AsyncClient) -> bool:
    """A request is waiting in the frontend because every worker is busy (its own gauge, read directly)."""
    text = (await c.get("/metrics")).text
    return any(
        s.value > 0
        for family in text_string_to_metric_families(text)
        if family.name == "ferry_router_queue_depth"
        for s in family.samples
    )


async def _query(c: httpx.AsyncClient, prom: str, expr: str) -> list[object]:
    r = await c.get(f"{prom}/api/v1/query", params={"query": expr})
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    result: list[object] = body["data"]["result"]
    return result


@pytest_asyncio.fixture
async def kafka() -> AsyncIterator[str]:
    """A broker of this test's own. Batch consumer groups are named by model: on the session's broker a
    frontend of another test still in the results group could take this batch's results, and it never ends."""
    child, addr = await start_broker()
    yield addr
    await child.stop()


async def test_every_dashboard_query_returns_series(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    ids = [f"dash-{i}-{prefix.rstrip(':')}" for i in range(2)]
    workers = dict(zip(ids, await asyncio.gather(*(
        worker_process(wid, kafka, redis_url, prefix, model_path, "--speedup", "1", "--max-num-seqs", "2")
        for wid in ids
    )), strict=True))  # fmt: skip
    front, url = await frontend_process(kafka, redis_url, prefix, model_path, "--busy-waiting", "1",
                                        "--batch-dir", str(tmp_path))  # fmt: skip
    monitor = await start_monitor(f"{url}/discovery/prometheus", scrape_s=0.5)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c, httpx.AsyncClient(timeout=10) as pc:
            # Ready is not scraping: the first scrape of a discovered target comes about 5 s after Prometheus is
            # ready (its discovery manager passes target updates on every 5 s), longer than the load below
            # lasts, so sent at once it was over before any worker was scraped. Wait until all three are.
            await until(lambda: _has(pc, monitor.url, "count(up == 1) == 3"), 60, 0.1)
            # More streams than the workers run at once: some queue in the engines; once the workers report
            # them waiting, they are busy and the next requests wait in the frontend for one.
            # (No shared prefix in these: load, not the cache, spreads them over both workers.)
            first = [asyncio.create_task(_stream(c, f"Question {i}?", 200, system="")) for i in range(8)]
            await until(lambda: _has(pc, monitor.url, "count(ferry_worker_engine_waiting > 0) >= 1"), 60, 0.1)
            # The frontend sees that load through heartbeats, a beat behind the workers' own metrics (later on
            # a busy machine): more requests, until one waits in the frontend for a worker.
            later: list[asyncio.Task[None]] = []
            while not await _waiting_in_frontend(c):
                assert len(later) < 40, "no request waited in the frontend for a busy worker"
                later.append(asyncio.create_task(_stream(c, f"Later question {len(later)}?")))
                await asyncio.sleep(0.2)  # pacing: each request adds load the next heartbeat reports
            await asyncio.gather(*first, *later)
            assert (await c.post("/v1/chat/completions", content=b"{")).status_code == 400
            await _batch(url)
            # A worker killed mid-stream: the stream moves to the other one.
            payload = {"model": MODEL, "stream": True, "max_tokens": 300, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "A long answer, please."}]}  # fmt: skip
            async with asyncio.timeout(60), c.stream("POST", "/v1/chat/completions", json=payload) as r:
                victim = r.headers["x-ferry-worker"]
                events = 0
                async for _ in sse_events(r):
                    events += 1
                    if events == 5:
                        workers.pop(victim).kill()
        async with httpx.AsyncClient(timeout=10) as pc:
            # Scraped after the move: then every counter the traffic touched is in Prometheus.
            await until(lambda: _has(pc, monitor.url, 'ferry_migrations_total{outcome="moved"}'), 30, 0.2)
            missing: list[str] = []
            planner_missing: list[str] = []
            has_planner = bool(await _query(pc, monitor.url, '{__name__=~"ferry_planner_.*"}'))
            for title, expr, optional in expressions():
                if await _query(pc, monitor.url, expr):
                    continue
                (planner_missing if optional and not has_planner else missing).append(f"{title}: {expr}")
        assert not missing, "queries without series:\n" + "\n".join(missing)
        # Named, not silently passed: without a planner its two panels have nothing to show.
        if not has_planner:
            assert len(planner_missing) == 2 and all("ferry_planner_" in m for m in planner_missing), (
                planner_missing
            )
    finally:
        await monitor.stop()
        await front.stop()
        await asyncio.gather(*(w.stop() for w in workers.values()), return_exceptions=True)


async def _has(c: httpx.AsyncClient, prom: str, expr: str) -> bool:
    return bool(await _query(c, prom, expr))
