"""A request the broker acknowledged and then lost (an empty restart) before its worker read it is sent again.

The loss is real: the worker's topic is deleted on the real broker while the worker's reader is paused,
and the worker is alive and heartbeating throughout, so nothing but the delivery check can notice.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx
import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bus.topics import delete_topics, ensure_topics
from schemas.kafka import (
    Cancel,
    GenerateRequest,
    SamplingParams,
    chunks_of,
    reply_decoder,
    request_decoder,
    request_encoder,
)
from schemas.names import request_topic
from server.delivery import RequestLog
from tests.harness import Harness

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def request(rid: str, attempt: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model=MODEL,
        prompt_token_ids=[1, 2, 3],
        max_tokens=4,
        reply_topic="nowhere",
        sampling=SamplingParams(),
        attempt=attempt,
    )


async def read_one(kafka: str, topic: str) -> GenerateRequest:
    """The first GenerateRequest in `topic` (waits for it)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False, fetch_max_wait_ms=100)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        async with asyncio.timeout(20):
            while True:
                for record in (await consumer.getmany(tp, timeout_ms=500)).get(tp, []):
                    msg = request_decoder.decode(record.value)
                    if isinstance(msg, GenerateRequest):
                        return msg
    finally:
        await consumer.stop()


async def test_request_log_tells_a_held_request_from_a_lost_one(kafka: str, prefix: str) -> None:
    worker_id = f"probe-{prefix.rstrip(':')}"
    topic = request_topic(worker_id)
    await ensure_topics(kafka, {topic: 1})
    producer = AIOKafkaProducer(bootstrap_servers=kafka)
    log = RequestLog(kafka)
    await producer.start()
    await log.start()
    try:

        async def put(msg: Any, rid: str) -> int:
            sent = await producer.send_and_wait(
                topic, request_encoder.encode(msg), key=rid.encode(), partition=0
            )
            return sent.offset

        first = await put(request("r1"), "r1")
        cancel = await put(Cancel("r1"), "r1")
        second = await put(request("r2", attempt=1), "r2")
        assert await log.holds(worker_id, first, request("r1")) is True
        assert await log.holds(worker_id, second, request("r2", attempt=1)) is True
        # The same request id under the same key, but not this attempt's request.
        assert await log.holds(worker_id, cancel, request("r1")) is False
        assert await log.holds(worker_id, second, request("r2", attempt=2)) is False
        assert await log.holds(worker_id, second + 5, request("r2", attempt=1)) is False
        # The broker loses the log; a new record takes offset 0.
        await delete_topics(kafka, [topic])
        await ensure_topics(kafka, {topic: 1})
        assert await log.holds(worker_id, second, request("r2", attempt=1)) is False
        assert await put(request("other"), "other") == first == 0
        assert await log.holds(worker_id, first, request("r1")) is False
    finally:
        await log.stop()
        await producer.stop()


async def test_a_request_the_broker_lost_is_sent_again(
    h: Harness, kafka: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = await h.add_worker()
    inbox = w.worker._inbox.reader
    fe, url = await h.add_frontend(delivery_check_s=1.0, request_timeout_s=60.0)
    # The request topics do not roll during the test (`--request-roll-s`): the clocks stand still.
    now = time.time()
    w.worker._inbox.topics.clock = fe.svc.dispatcher.topics.clock = lambda: now
    topic = fe.svc.dispatcher.topics.current(w.worker.settings.worker_id)
    # The worker stops reading (it keeps heartbeating): the request waits in the broker, as under load.
    inbox.pause(TopicPartition(topic, 0))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        call = asyncio.create_task(c.post("/v1/chat/completions", json=body))
        sent = await read_one(kafka, topic)
        # The broker loses it (as Tansu does when it restarts empty), then the worker reads again, from
        # the start of a log that lost what it had read.
        await delete_topics(kafka, [topic])
        await ensure_topics(kafka, {topic: 1})
        inbox.resume(TopicPartition(topic, 0))
        r = await call
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert r.headers["x-request-id"] == sent.request_id.rsplit(".", 1)[0]
    assert fe.metrics.requests_lost._value.get() == 1
    assert fe.metrics.worker_failures._value.get() == 0


async def test_replies_lost_after_the_broker_lost_its_log_are_asked_for_again(h: Harness, kafka: str) -> None:
    """Right after an empty restart Tansu can also lose replies a worker wrote, with the request still in
    the worker's topic. For a while after the frontend saw its replies log go, a silent first attempt is
    sent again anyway."""
    w = await h.add_worker()
    fe, url = await h.add_frontend(delivery_check_s=1.0, request_timeout_s=60.0)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        assert (await c.post("/v1/chat/completions", json=body)).status_code == 200
        noticed = asyncio.Event()
        on_reset = fe.svc.demux.on_reset

        def reset_seen() -> None:
            if on_reset is not None:
                on_reset()
            noticed.set()

        fe.svc.demux.on_reset = reset_seen
        # The broker loses the frontend's replies log (as Tansu does when it restarts empty).
        topic = fe.svc.demux.topic
        await delete_topics(kafka, [topic])
        await ensure_topics(kafka, {topic: 1})
        async with asyncio.timeout(20):
            await noticed.wait()  # the reader notices on its next idle poll
        assert fe.svc.migrations.log_lost_at > -math.inf
        # Every reply the worker writes for the first attempt of the next request vanishes, acknowledged.
        producer = w.worker._producer
        assert producer is not None
        send = producer.send
        swallowed: list[str] = []

        async def lossy_send(topic: str, value: bytes, **kw: Any) -> asyncio.Future[Any]:
            try:
                chunks = chunks_of(reply_decoder.decode(value))
            except msgspec.ValidationError:
                return await send(topic, value, **kw)
            if all(c.attempt == 0 for c in chunks):
                swallowed.extend(c.request_id for c in chunks)
                done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done
            return await send(topic, value, **kw)

        producer.send = lossy_send  # type: ignore[method-assign]
        r = await c.post("/v1/chat/completions", json=body)
    assert swallowed, "the worker never answered the first attempt"
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
    assert fe.metrics.requests_lost._value.get() == 1
