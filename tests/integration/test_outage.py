"""Broker and Redis outages: the real processes are stopped and started again under a running Ferry.

Each test starts a broker and a Redis of its own (the session's are shared by every other test), a sim
worker and a frontend, then stops one of the services. While it is down, new requests must get a clear
answer within the client's timeout (never hang); once it is back on the same port, the same frontend and
worker must serve again without a restart. Tansu keeps data in memory only: a restarted broker is empty,
so every topic is created again on demand and every consumer starts over on it.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from launch.services import Child, restart_redis, start_broker, start_redis
from tests.harness import Harness, harness, sse_events

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
# The client's own timeout bounds every request made while a service is down: a hang fails the test.
CLIENT_TIMEOUT_S = 20.0
RECOVERY_DEADLINE_S = 60.0


def chat(content: str = "Hello there", **kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


@dataclass
class Services:
    """A broker and a Redis of this test's own, restartable on their ports."""

    broker: Child
    kafka: str
    redis: Child
    redis_url: str

    async def restart_broker(self) -> None:
        """Start a new (empty) broker on the same port."""
        self.broker, _ = await start_broker(int(self.kafka.rsplit(":", 1)[1]))

    async def restart_redis(self) -> None:
        """Start a new (empty) Redis on the same port."""
        self.redis = await restart_redis(self.redis_url)


@pytest_asyncio.fixture
async def services() -> AsyncIterator[Services]:
    broker, kafka = await start_broker()
    redis, redis_url = await start_redis()
    svc = Services(broker, kafka, redis, redis_url)
    try:
        yield svc
    finally:
        await svc.broker.stop()
        await svc.redis.stop()


@pytest_asyncio.fixture
async def h(services: Services, model_path: Path) -> AsyncIterator[Harness]:
    async with harness(services.kafka, services.redis_url, f"t{uuid.uuid4().hex[:8]}:", model_path) as hh:
        yield hh


async def until(check: Callable[[], Awaitable[bool]], deadline_s: float, what: str) -> None:
    """Poll `check` until it holds (each poll is itself a real request, bounded by the client timeout)."""
    end = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {deadline_s:.0f}s")
        await asyncio.sleep(0.2)  # pacing between polls of a state that has no event to await


async def served(c: httpx.AsyncClient, stream: bool = False) -> bool:
    """True if a whole chat completion (or a stream ending in [DONE] with a finish reason) comes back."""
    try:
        if not stream:
            r = await c.post("/v1/chat/completions", json=chat())
            return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
            if r.status_code != 200:
                return False
            events = [d async for _, d in sse_events(r)]
        finals = [json.loads(d)["choices"][0]["finish_reason"] for d in events[:-1] if '"choices"' in d]
        return events[-1] == "[DONE]" and finals[-1] == "length"
    except httpx.TransportError:
        return False


async def test_broker_outage_is_503_and_nothing_hangs(services: Services, h: Harness) -> None:
    await h.add_worker(heartbeat_interval_s=1.0, speedup=1.0)
    # A short no-progress timeout, so an in-flight stream cut off by the outage ends within the test.
    _fe, url = await h.add_frontend(kafka_timeout_s=2.0, heartbeat_interval_s=1.0, request_timeout_s=5.0)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving before the outage")
        long = chat(stream=True, max_tokens=3000, ignore_eos=True)
        async with c.stream("POST", "/v1/chat/completions", json=long) as r:
            assert r.status_code == 200
            events = sse_events(r)
            await anext(events)  # the stream is running on the worker
            await services.broker.stop()
            # The in-flight stream ends with a clear error event, then [DONE]: it does not hang.
            rest, arrived = [], []
            async for _, d in events:
                rest.append(d)
                arrived.append(time.monotonic())
        assert rest[-1] == "[DONE]"
        # On time: the no-progress timeout (5 s) counts from the last chunk, not from the next keep-alive (15 s).
        assert arrived[-2] - arrived[-3] < 5.0 + 3.0, arrived[-2] - arrived[-3]
        assert json.loads(rest[-2])["error"]["code"] in ("timeout", "broker_unavailable", "worker_died"), (
            rest[-2]
        )
        # The broker is gone: every new request is refused clearly, with Retry-After, and nothing hangs.
        for stream in (False, True, False):
            r = await c.post("/v1/chat/completions", json=chat(stream=stream))
            assert r.status_code == 503, r.text
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["code"] == "broker_unavailable"
        assert (await c.get("/health")).status_code == 200
    # Back before the harness stops it all: stopping during an outage is a test of its own (below, the worker
    # given up on), and here it would wait out every flush and commit deadline.
    await services.restart_broker()


async def test_broker_restart_recovers_without_restarting_ferry(services: Services, h: Harness) -> None:
    w = await h.add_worker(heartbeat_interval_s=1.0)
    fe, url = await h.add_frontend(kafka_timeout_s=2.0, heartbeat_interval_s=1.0)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving before the outage")
        await services.broker.stop()
        r = await c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503, r.text
        await services.restart_broker()
        # An empty broker: topics come back on demand and the same frontend and worker serve again.
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving after the broker came back")
        assert await served(c, stream=True)
        for _ in range(5):
            assert await served(c)
    assert not w.task.done(), "the worker stopped"
    assert h.frontends == [fe]


async def test_an_idle_worker_reads_its_inbox_again_after_an_empty_broker_restart(
    services: Services, h: Harness
) -> None:
    """A worker that saw no failure of its own (no send, no commit during the outage) still finds that its
    position lies past the new, empty log's end, and reads the requests sent there from its start.

    The frontend's delivery check stays on (5 s): it cannot make a worker read its inbox, but it recovers
    replies Tansu loses in the first seconds after its restart, which this test is not about."""
    await h.add_worker(heartbeat_interval_s=1.0)
    _fe, url = await h.add_frontend(kafka_timeout_s=2.0, heartbeat_interval_s=1.0, delivery_check_s=5.0)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving before the outage")
        for _ in range(10):  # the worker's inbox position moves well past where a new log starts
            assert await served(c)
        await services.broker.stop()
        await services.restart_broker()
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving after the broker came back")
        # Requests the frontend sent into the new log before the worker found its way there were not
        # lost: each is answered (none waits for a timeout), in order.
        for _ in range(3):
            assert await served(c)


async def test_stream_in_flight_survives_an_empty_broker_restart(services: Services, h: Harness) -> None:
    """The broker comes back without the request or the chunks in transit: the stream is sent again and
    continues as one stream (no gap, no repeat, the full length)."""
    await h.add_worker(heartbeat_interval_s=1.0, speedup=1.0)
    _fe, url = await h.add_frontend(kafka_timeout_s=2.0, heartbeat_interval_s=1.0)
    n = 1500
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as c:
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving before the outage")
        body = chat(stream=True, max_tokens=n, ignore_eos=True, stream_options={"include_usage": True})
        # Resumable, so that its events carry ids and a repeat would show.
        resumable = {"x-ferry-resumable": "1"}
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=resumable) as r:
            assert r.status_code == 200
            assert r.headers["x-ferry-resumable"] == "1"
            events = sse_events(r)
            got = [await anext(events)]  # the stream is running on the worker
            await services.broker.stop()
            await services.restart_broker()
            got += [e async for e in events]
    ids = [i for i, _ in got if i is not None]
    datas = [d for _, d in got]
    assert datas[-1] == "[DONE]"
    assert not any('"error"' in d for d in datas), [d for d in datas if '"error"' in d]
    assert ids and len(ids) == len(set(ids)), "an event was repeated"
    assert json.loads(datas[-2])["usage"]["completion_tokens"] == n, datas[-4:]
    choices = [c for d in datas[:-1] for c in json.loads(d)["choices"]]
    assert choices[-1]["finish_reason"] == "length"


async def test_an_empty_redis_restart_loses_no_worker(services: Services, h: Harness) -> None:
    """Redis comes back without its data: the workers are not dead, only unregistered until their next
    heartbeat. Requests meanwhile are served, and the stream in flight is not moved, by either of two
    frontends (whichever reads the new Redis first, the other must notice too)."""
    # The frontends read the registry every 0.25 s, so they see the empty Redis before the worker's next
    # heartbeat (every 2 s) registers it again.
    await h.add_worker(heartbeat_interval_s=2.0, speedup=1.0)
    fe, url = await h.add_frontend(heartbeat_interval_s=0.5)
    fe2, url2 = await h.add_frontend(heartbeat_interval_s=0.5)
    async with (
        httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as c,
        httpx.AsyncClient(base_url=url2, timeout=CLIENT_TIMEOUT_S) as c2,
    ):
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving before the restart")
        await until(lambda: served(c2), RECOVERY_DEADLINE_S, "the second frontend serving before the restart")
        body = chat(stream=True, max_tokens=1000, ignore_eos=True)
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events(r)
            got = [await anext(events)]
            await services.redis.stop()
            await services.restart_redis()
            # Every request while the workers register again is served: none is refused for want of one.
            for client, stream in ((c, False), (c2, True), (c, True), (c2, False)):
                assert await served(client, stream=stream)
            got += [e async for e in events]
        assert got[-1][1] == "[DONE]"
        assert not any('"error"' in d for _, d in got)
    assert fe.metrics.worker_failures._value.get() == 0  # nothing was moved
    assert fe2.metrics.worker_failures._value.get() == 0


async def test_redis_outage_keeps_serving_and_heartbeats_resume(services: Services, h: Harness) -> None:
    w = await h.add_worker(heartbeat_interval_s=1.0)
    fe, url = await h.add_frontend(heartbeat_interval_s=1.0)
    wid = w.worker.settings.worker_id
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
        await until(lambda: served(c), RECOVERY_DEADLINE_S, "serving before the outage")
        await services.redis.stop()
        # Routing falls back to the frontend's last view of the workers and its local load.
        for stream in (False, True, False):
            assert await served(c, stream=stream)

        async def redis_down_noticed() -> bool:
            return "ferry_redis_up 0.0" in (await c.get("/metrics")).text

        await until(redis_down_noticed, RECOVERY_DEADLINE_S, "the frontend noticing Redis is down")
        assert await served(c)
        await services.restart_redis()

        async def registered_again() -> bool:
            r = await c.get("/ready")
            return (
                r.status_code == 200
                and wid in r.json()["workers"]
                and "ferry_redis_up 1.0" in (await c.get("/metrics")).text
            )

        # The restarted Redis is empty: the worker's heartbeats register it again by themselves.
        await until(registered_again, RECOVERY_DEADLINE_S, "the worker re-registering in the new Redis")
        assert wid in fe.svc.pool.workers
        for stream in (False, True):
            assert await served(c, stream=stream)
    assert not w.task.done()


async def test_a_worker_given_up_on_during_an_outage_still_closes_its_kafka_clients(
    services: Services, h: Harness
) -> None:
    """Draining with the broker down takes long; a supervisor (or a test) that stops waiting cancels the
    worker. Its Kafka clients must close anyway, or they keep reconnecting to the broker forever."""
    w = await h.add_worker(heartbeat_interval_s=1.0)
    await services.broker.stop()
    w.shutdown.set()
    w.task.cancel()  # the supervisor stops waiting for the drain
    done, _ = await asyncio.wait([w.task], timeout=60)
    if not done:
        stacks = io.StringIO()
        for t in asyncio.all_tasks():
            t.print_stack(file=stacks)
        raise AssertionError(f"the cancelled worker did not end:\n{stacks.getvalue()}")
    closing = w.worker._closing
    assert closing is not None
    await asyncio.wait_for(asyncio.shield(closing), 60)
    producer = w.worker._producer
    assert producer is not None and producer._closed
