"""A worker killed mid-stream (SIGKILL, real processes): the sequence moves on and the client never notices.

Also: a request delivered twice to a worker runs once.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis
from aiokafka.errors import UnknownError

from kvstore.registry import Registry
from launch.services import Child
from schemas.kafka import SamplingParams, chunks_of, reply_decoder
from schemas.names import RedisKeys
from tests.harness import Harness, RunningWorker, sse_events, worker_process
from tests.integration.test_worker import Client
from workers.outbox import SEND_TRIES

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def body(**kw: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about ferries"}],
        "max_tokens": 120,
        "ignore_eos": True,
        "seed": 11,
        **kw,
    }


async def start_workers(
    n: int, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> dict[str, Child]:
    # Real time steps (speedup 1): a 120-token answer takes long enough to kill its worker midway.
    ids = [f"mig-{i}-{prefix.rstrip(':')}" for i in range(n)]
    children = await asyncio.gather(
        *(worker_process(wid, kafka, redis_url, prefix, model_path, "--speedup", "1") for wid in ids)
    )
    return dict(zip(ids, children, strict=True))


async def stop_all(children: dict[str, Child]) -> None:
    await asyncio.gather(*(c.stop() for c in children.values()), return_exceptions=True)


async def busy_worker(redis_url: str, prefix: str, among: set[str], wait_s: float = 10) -> str:
    """The worker among `among` whose heartbeat reports a running sequence."""
    redis = aioredis.from_url(redis_url)
    try:
        registry = Registry(redis, RedisKeys(prefix))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            live, _ = await registry.snapshot()
            for w in live:
                if w.worker_id in among and w.running > 0:
                    return w.worker_id
            await asyncio.sleep(0.05)  # heartbeat-driven state: poll it
        raise AssertionError("no worker reported the running sequence")
    finally:
        await redis.aclose()


def text_of(events: list[tuple[str | None, str]]) -> str:
    out = []
    for _id, data in events:
        if data == "[DONE]":
            continue
        for ch in json.loads(data).get("choices", []):
            out.append(ch["delta"].get("content", ""))
    return "".join(out)


def assert_one_stream(events: list[tuple[str | None, str]], reference: list[tuple[str | None, str]]) -> None:
    """A moved stream reads as the uninterrupted reference: no error, the same text and usage."""
    assert not any('"error"' in d for _, d in events), events[-3:]
    assert text_of(events) == text_of(reference)
    assert json.loads(events[-2][1])["usage"] == json.loads(reference[-2][1])["usage"]


async def test_killed_worker_stream_continues_as_one_stream(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    children = await start_workers(2, kafka, redis_url, prefix, model_path)
    try:
        fe, url = await h.add_frontend()
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body(**opts)) as r:
                reference = [e async for e in sse_events(r)]
            async with c.stream("POST", "/v1/chat/completions", json=body(**opts)) as r:
                victim = r.headers["x-ferry-worker"]
                events: list[tuple[str | None, str]] = []
                async with asyncio.timeout(30):  # never a hang
                    async for e in sse_events(r):
                        events.append(e)
                        if len(events) == 10:
                            children[victim].kill()
            # The whole answer is the same too, when it is collected rather than streamed.
            whole = (await c.post("/v1/chat/completions", json=body())).json()
        assert_one_stream(events, reference)
        assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 120
        finals = [json.loads(d)["choices"][0]["finish_reason"] for _, d in events[:-2]]
        assert finals[-1] == "length" and finals[:-1] == [None] * (len(finals) - 1)
        assert whole["choices"][0]["message"]["content"] == text_of(reference)
        assert fe.metrics.worker_failures._value.get() == 1  # it did move
    finally:
        await stop_all(children)


async def test_migration_limit_exhausted_ends_with_error_event(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    children = await start_workers(3, kafka, redis_url, prefix, model_path)
    try:
        _fe, url = await h.add_frontend(migration_limit=1)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body(max_tokens=400, stream=True)) as r:
                first = r.headers["x-ferry-worker"]
                events: list[str] = []
                killed: list[str] = []
                async with asyncio.timeout(30):
                    async for _id, data in sse_events(r):
                        events.append(data)
                        if len(events) == 5:
                            children[first].kill()
                            killed.append(first)
                        elif len(killed) == 1 and len(events) > 5 and '"content"' in data:
                            # Output flows again: the sequence moved. Kill its second worker as well.
                            second = await busy_worker(redis_url, prefix, set(children) - set(killed))
                            children[second].kill()
                            killed.append(second)
        assert len(killed) == 2
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "worker_died"
        assert "migration limit 1" in err["message"]
    finally:
        await stop_all(children)


async def test_worker_restarted_under_its_id_before_its_entry_expired(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    # A supervisor restarts a killed worker at once, under the same id: its registry entry never expires
    # (a 10 s heartbeat keeps it for 30 s), but what the old process was running is gone. The new start
    # time tells the frontend, which moves the sequence; the only worker there is is the new process.
    wid = f"again-{prefix.rstrip(':')}"
    slow_heartbeat = ("--speedup", "1", "--heartbeat-interval-s", "10")
    child = await worker_process(wid, kafka, redis_url, prefix, model_path, *slow_heartbeat)
    try:
        fe, url = await h.add_frontend()
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body(**opts)) as r:
                reference = [e async for e in sse_events(r)]
            async with c.stream("POST", "/v1/chat/completions", json=body(**opts)) as r:
                assert r.headers["x-ferry-worker"] == wid
                events: list[tuple[str | None, str]] = []
                async with asyncio.timeout(45):  # never a hang
                    async for e in sse_events(r):
                        events.append(e)
                        if len(events) == 10:
                            child.kill()
                            await child.proc.wait()
                            child = await worker_process(
                                wid, kafka, redis_url, prefix, model_path, *slow_heartbeat
                            )
        assert_one_stream(events, reference)
        assert fe.metrics.worker_failures._value.get() == 1
    finally:
        await child.stop()


async def test_no_worker_left_non_streaming_is_5xx(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    children = await start_workers(1, kafka, redis_url, prefix, model_path)
    try:
        _fe, url = await h.add_frontend()
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            pending = asyncio.create_task(c.post("/v1/chat/completions", json=body(max_tokens=1000)))
            victim = await busy_worker(redis_url, prefix, set(children))
            children[victim].kill()
            async with asyncio.timeout(30):
                r = await pending
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "worker_died"
        assert "no other worker" in r.json()["error"]["message"]
    finally:
        await stop_all(children)


async def test_request_delivered_twice_runs_once(h: Harness, kafka: str) -> None:
    w = await h.add_worker()
    wid = w.worker.settings.worker_id
    client = Client(kafka)
    await client.start()
    try:
        req = client.request(list(range(40)), max_tokens=5, sampling=SamplingParams(ignore_eos=True))
        await client.send(wid, req)
        first = (await client.until_finished({req.request_id}))[req.request_id]
        assert sum(len(c.token_ids) for c in first) == 5
        # The same message again after it finished (a producer retry, a re-read after a restart) ...
        await client.send(wid, req)
        # ... and a marker request behind it on the same partition: once that one is done, the
        # duplicate has certainly been read.
        after = client.request(list(range(40, 80)), max_tokens=2)
        await client.send(wid, after)
        seen: list[str] = []
        async with asyncio.timeout(20):
            while after.request_id not in seen:
                batches = await client.consumer.getmany(timeout_ms=200)
                seen += [
                    c.request_id
                    for rs in batches.values()
                    for r in rs
                    for c in chunks_of(reply_decoder.decode(r.value))
                ]
        assert req.request_id not in seen
        assert w.worker.metrics.requests.labels("duplicate")._value.get() == 1
        # A migrated attempt of the same request is new work, not a duplicate.
        tokens = [t for c in first for t in c.token_ids]
        moved = msgspec.structs.replace(
            req, attempt=1, generated_token_ids=tokens[:2], max_tokens=3, seq_base=2
        )
        await client.send(wid, moved)
        chunks = (await client.until_finished({req.request_id}))[req.request_id]
        assert [c.seq for c in chunks] == [2, 3, 4]
        assert {c.attempt for c in chunks} == {1}
        assert sum(len(c.token_ids) for c in chunks) == 3
        assert [t for c in chunks for t in c.token_ids] == tokens[2:]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    finally:
        await client.stop()


async def test_worker_back_after_a_late_heartbeat_takes_its_own_sequence_over(
    h: Harness, redis_url: str, prefix: str
) -> None:
    # One worker, alive all along, whose registry entry vanishes once (as when heartbeats are late): the
    # frontend moves the sequence, and the only worker to move it to is the same one, where the old
    # attempt is still running. It must stop that one and run the new attempt: one stream, same text.
    w = await h.add_worker(speedup=1.0)
    wid = w.worker.settings.worker_id
    fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with asyncio.timeout(20):  # the frontend's registry view is refreshed in the background
            for _ in iter(int, 1):
                if (await c.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
        reference = (await c.post("/v1/chat/completions", json=body(max_tokens=600))).json()
        assert "choices" in reference, reference
        async with c.stream("POST", "/v1/chat/completions", json=body(max_tokens=600, stream=True)) as r:
            events: list[tuple[str | None, str]] = []
            async with asyncio.timeout(30):
                async for e in sse_events(r):
                    events.append(e)
                    if len(events) == 5:
                        # Until the frontend's view (refreshed every half heartbeat) has missed it once.
                        redis = aioredis.from_url(redis_url)
                        for _ in range(200):
                            await Registry(redis, RedisKeys(prefix)).remove(wid)
                            await asyncio.sleep(0.02)
                            if wid not in fe.svc.pool.workers:
                                break
                        await redis.aclose()
    assert not any('"error"' in d for _, d in events), events[-3:]
    assert text_of(events) == reference["choices"][0]["message"]["content"]
    assert fe.metrics.worker_failures._value.get() == 1  # it did move


def refuse_produce(w: RunningWorker, chunk_seq: int, times: int) -> list[str]:
    """Make the worker's broker refuse the first record carrying reply chunk `chunk_seq` (alone or joined with its
    neighbours), `times` times, the way Tansu refuses a produce after an empty restart. Returns the request id it
    hit (once it has)."""
    worker = w.worker
    producer = worker._producer
    assert producer is not None
    send = producer.send
    hit: list[str] = []
    refused: list[bytes] = []

    async def failing_send(topic: str, value: bytes, **kw: Any) -> asyncio.Future[Any]:
        try:
            chunks = chunks_of(reply_decoder.decode(value))
        except msgspec.ValidationError:
            return await send(topic, value, **kw)
        first = [c for c in chunks if not hit and c.seq <= chunk_seq < c.end and c.attempt == 0]
        if (first or value in refused) and len(refused) < times:
            if first:
                hit[:] = [first[0].request_id]
            refused.append(value)
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.set_exception(UnknownError())
            return fut
        return await send(topic, value, **kw)

    producer.send = failing_send  # type: ignore[method-assign]
    return hit


async def test_a_reply_chunk_the_broker_never_took_moves_the_sequence(h: Harness, prefix: str) -> None:
    # Refused every time: the chunks after it land, the frontend sees the gap, and the sequence moves
    # with the tokens that did arrive. The stream goes on as one stream with nothing missing.
    w = await h.add_worker()
    fe, url = await h.add_frontend()
    opts = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 40}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body(**opts)) as r:
            reference = [e async for e in sse_events(r)]
        hit = refuse_produce(w, chunk_seq=5, times=SEND_TRIES)
        async with asyncio.timeout(30):
            async with c.stream("POST", "/v1/chat/completions", json=body(**opts)) as r:
                events = [e async for e in sse_events(r)]
    assert hit, "the injected failure never fired"
    assert text_of(events) == text_of(reference)
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 40
    assert fe.metrics.reply_gaps._value.get() == 1
    assert w.worker.metrics.kafka_send_errors._value.get() == SEND_TRIES


async def test_a_final_chunk_refused_once_is_sent_again(h: Harness, prefix: str) -> None:
    # The last chunk has nothing behind it to reveal a gap: without the worker's second send the
    # request would wait for --request-timeout-s.
    w = await h.add_worker()
    fe, url = await h.add_frontend(request_timeout_s=60)
    hit = refuse_produce(w, chunk_seq=7, times=1)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c, asyncio.timeout(30):
        r = await c.post("/v1/chat/completions", json=body(max_tokens=8))
    assert hit
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    assert fe.metrics.reply_gaps._value.get() == 0
    assert w.worker.metrics.kafka_send_errors._value.get() == 1
