"""Drain: SIGTERM to a real worker or frontend process lets open work finish; a new worker gets traffic.

- A worker that gets SIGTERM leaves routing at once (while its streams still run), finishes them,
  commits its offsets and exits 0.
- A frontend that gets SIGTERM takes no new requests (it stops listening; a request that reaches it
  anyway gets 503 `shutting_down`), finishes its open streams and exits 0.
- A worker added while traffic flows is chosen by the router within seconds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.names import request_topic
from tests.harness import Harness, frontend_process, sse_events, stream_with_fault, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def chat(max_tokens: int, stream: bool = True, content: str = "Tell me a story") -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }


async def full_stream(
    c: httpx.AsyncClient, max_tokens: int, started: asyncio.Event | None = None
) -> tuple[str, int]:
    """Run one stream to its end: (worker that served it, completion tokens); fails on any error event."""
    body = {**chat(max_tokens), "stream_options": {"include_usage": True}}
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        worker = r.headers["x-ferry-worker"]
        events = []
        async for _, data in sse_events(r):
            events.append(data)
            if data != "[DONE]":
                assert "error" not in json.loads(data), data
            if started is not None and len(events) > 2:
                started.set()  # tokens are flowing
    assert events[-1] == "[DONE]"
    finals = [json.loads(d)["choices"][0]["finish_reason"] for d in events[:-2]]
    assert finals[-1] == "length"
    return worker, int(json.loads(events[-2])["usage"]["completion_tokens"])


async def committed_and_end(kafka: str, worker_id: str) -> tuple[int | None, int]:
    """The worker's committed offsets on its request topics (the rolled ones too), summed over those holding
    records, and the sum of the offsets after their last records."""
    group = AIOKafkaConsumer(
        bootstrap_servers=kafka, group_id=f"ferry-worker-{worker_id}", enable_auto_commit=False
    )
    reader = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False, fetch_max_wait_ms=50)
    await group.start()
    await reader.start()
    committed_sum: int | None = 0
    end_sum = 0
    try:
        base = request_topic(worker_id)
        for topic in sorted(t for t in await reader.topics() if t == base or t.startswith(f"{base}.e")):
            tp = TopicPartition(topic, 0)
            # Read to the end rather than ask for the end offset: the record count is what was delivered.
            reader.assign([tp])
            await reader.seek_to_beginning(tp)
            end = 0
            while records := (await reader.getmany(tp, timeout_ms=500)).get(tp):
                end = records[-1].offset + 1
            if end == 0:
                continue
            committed = await group.committed(tp)
            end_sum += end
            committed_sum = None if committed is None or committed_sum is None else committed_sum + committed
    finally:
        await group.stop()
        await reader.stop()
    return committed_sum, end_sum


async def test_sigterm_worker_leaves_routing_finishes_commits_and_exits_0(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    wid = f"w-drain-{uuid.uuid4().hex[:6]}"
    # Real-time steps: 150 tokens take a good second, long enough to watch the drain from outside.
    child = await worker_process(wid, kafka, redis_url, prefix, model_path, "--speedup", "1")
    try:
        fe, url = await h.add_frontend(router_policy="round_robin")
        await fe.svc.pool.refresh()
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(full_stream(c, 150, e)) for e in started]
            await asyncio.gather(*(e.wait() for e in started))  # all three are generating on the worker
            child.proc.send_signal(signal.SIGTERM)
            # Out of routing at once: the frontend stops choosing it while its streams still run.
            deadline = time.monotonic() + 10
            while wid in {w.worker_id for w in fe.svc.pool.live(MODEL)}:
                assert time.monotonic() < deadline, "the draining worker stayed in routing"
                await asyncio.sleep(0.05)  # the registry view refreshes on a timer
            assert not all(s.done() for s in streams), "the streams ended before the worker left routing"
            # A worker added now takes the new requests; the draining one gets none.
            fresh = await h.add_worker()
            r = await c.post("/v1/chat/completions", json=chat(4, stream=False))
            assert r.status_code == 200 and r.headers["x-ferry-worker"] == fresh.worker.settings.worker_id
            # Its in-flight streams finish whole.
            for worker, tokens in await asyncio.gather(*streams):
                assert worker == wid and tokens == 150
        assert await asyncio.wait_for(child.proc.wait(), 30) == 0
        committed, end = await committed_and_end(kafka, wid)
        assert committed == end, (committed, end)
        assert wid not in fe.svc.pool.workers or fe.svc.pool.workers[wid].draining
    finally:
        await child.stop()


async def test_a_stream_outlasting_the_drain_grace_moves_to_another_worker(h: Harness) -> None:
    # Real-time steps and a half-second grace: the stream is still running when the grace is over.
    victim = await h.add_worker(speedup=1.0, drain_grace_s=0.5)
    fe, url = await h.add_frontend()
    vid = victim.worker.settings.worker_id
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about ferries."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
    rescuers = []

    async def drain() -> None:
        rescuers.append(await h.add_worker())
        victim.shutdown.set()  # as SIGTERM

    await stream_with_fault(url, body, vid, drain)
    assert await asyncio.wait_for(victim.task, 30) == 0  # a drain, not a failure
    assert rescuers[0].worker.metrics.generated_tokens._value.get() > 0  # the rest was generated there
    assert fe.metrics.migrations.labels("worker_died", "moved")._value.get() == 1


async def test_sigterm_frontend_refuses_new_finishes_open_streams_and_exits_0(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    await h.add_worker(speedup=1.0)
    front, url = await frontend_process(kafka, redis_url, prefix, model_path)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for _ in range(100):
                if (await c.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.1)  # the frontend's registry view refreshes on a timer
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(full_stream(c, 150, e)) for e in started]
            await asyncio.gather(*(e.wait() for e in started))
            front.proc.send_signal(signal.SIGTERM)
            # New requests are refused: the port no longer accepts connections, the app says 503, or
            # uvicorn closes a connection it accepted just before SIGTERM without reading its request
            # (its shutdown closes every connection with no request in progress; the app never sees it).
            async with httpx.AsyncClient(base_url=url, timeout=10) as fresh:
                deadline = time.monotonic() + 10
                while True:
                    try:
                        r = await fresh.post("/v1/chat/completions", json=chat(4, stream=False))
                    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                        break
                    if r.status_code == 503:
                        assert r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"]
                        break
                    assert time.monotonic() < deadline, "a draining frontend kept accepting new requests"
            assert not all(s.done() for s in streams), "the streams ended before the check could run"
            for _worker, tokens in await asyncio.gather(*streams):
                assert tokens == 150
        assert await asyncio.wait_for(front.proc.wait(), 40) == 0
    finally:
        await front.stop()


async def test_a_worker_added_under_traffic_gets_requests_within_seconds(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    first = await h.add_worker()
    _fe, url = await h.add_frontend()
    stop = asyncio.Event()
    served_by: list[str] = []

    async def client(c: httpx.AsyncClient, k: int) -> None:
        i = 0
        while not stop.is_set():
            # Distinct prompts, so the cache-aware router has no reason to stay on the first worker.
            body = chat(8, stream=False, content=f"client {k} request {i} {uuid.uuid4().hex}")
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            served_by.append(r.headers["x-ferry-worker"])
            i += 1

    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        clients = [asyncio.create_task(client(c, k)) for k in range(4)]
        try:
            while len(served_by) < 8:  # noqa: ASYNC110 - polls the clients' progress
                await asyncio.sleep(0.05)  # traffic is flowing before the new worker arrives
            # A process of its own, as an operator would start one: the frontend learns of it from Redis.
            new_id = f"w-new-{uuid.uuid4().hex[:6]}"
            second = await worker_process(new_id, kafka, redis_url, prefix, model_path, "--speedup", "50")
            before = len(served_by)
            deadline = time.monotonic() + 10
            while new_id not in served_by[before:]:
                assert time.monotonic() < deadline, "the new worker got no traffic within 10 s"
                assert not any(t.done() for t in clients), [t.exception() for t in clients if t.done()]
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            try:
                await asyncio.gather(*clients)
            finally:
                # Even when a client failed: a worker process left running costs the rest of the run a tenth of
                # a core.
                if "second" in locals():
                    await second.stop()
    assert first.worker.settings.worker_id in served_by
