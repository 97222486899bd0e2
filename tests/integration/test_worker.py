"""A worker against a real broker and Redis: requests in over Kafka, chunks out over Kafka."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bus.topics import ensure_topics
from kvstore.registry import Registry
from schemas.kafka import (
    Cancel,
    Chunk,
    GenerateRequest,
    SamplingParams,
    chunks_of,
    reply_decoder,
    request_encoder,
)
from schemas.names import RedisKeys, request_topic
from tests.harness import Harness, harness

pytestmark = pytest.mark.integration


class Client:
    """Plays a frontend: produces requests, reads its own reply topic."""

    def __init__(self, kafka: str) -> None:
        self.kafka = kafka
        self.topic = f"ferry.replies.test-{uuid.uuid4().hex[:6]}"
        self.producer = AIOKafkaProducer(bootstrap_servers=kafka)
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka, enable_auto_commit=False, fetch_max_wait_ms=50
        )

    async def start(self) -> None:
        await ensure_topics(self.kafka, {self.topic: 1})
        await self.producer.start()
        await self.consumer.start()
        tp = TopicPartition(self.topic, 0)
        self.consumer.assign([tp])
        await self.consumer.seek_to_beginning(tp)

    async def stop(self) -> None:
        await self.producer.stop()
        await self.consumer.stop()

    async def send(self, worker_id: str, msg: GenerateRequest | Cancel) -> None:
        rid = msg.request_id.encode()
        await self.producer.send_and_wait(request_topic(worker_id), request_encoder.encode(msg), key=rid)

    def request(self, prompt: list[int], max_tokens: int = 8, **kw: object) -> GenerateRequest:
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            model="SmolLM2-135M-Instruct",
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            reply_topic=self.topic,
            **kw,  # type: ignore[arg-type]
        )

    async def first_tokens(self, request_id: str, wait_s: float = 20) -> list[Chunk]:
        """Chunks of `request_id` up to and including the first that carries tokens."""
        seen: list[Chunk] = []
        async with asyncio.timeout(wait_s):
            while True:
                batches = await self.consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for r in records:
                        for c in chunks_of(reply_decoder.decode(r.value)):
                            if c.request_id == request_id:
                                seen.append(c)
                if any(c.token_ids for c in seen):
                    return seen

    async def until_finished(self, request_ids: set[str], wait_s: float = 20) -> dict[str, list[Chunk]]:
        out: dict[str, list[Chunk]] = {rid: [] for rid in request_ids}
        done: set[str] = set()
        async with asyncio.timeout(wait_s):
            while done != request_ids:
                batches = await self.consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for r in records:
                        for c in chunks_of(reply_decoder.decode(r.value)):
                            if c.request_id in out:
                                out[c.request_id].append(c)
                                if c.finish_reason is not None:
                                    done.add(c.request_id)
        return out


@pytest_asyncio.fixture
async def env(
    kafka: str, redis_url: str, prefix: str, model_path: Path
) -> AsyncIterator[tuple[Harness, Client]]:
    async with harness(kafka, redis_url, prefix, model_path) as h:
        client = Client(kafka)
        await client.start()
        try:
            yield h, client
        finally:
            await client.stop()


async def test_generate_streams_ordered_chunks_with_usage(env: tuple[Harness, Client]) -> None:
    h, client = env
    w = await h.add_worker()
    wid = w.worker.settings.worker_id
    req = client.request(list(range(100, 300)), max_tokens=12, sampling=SamplingParams(ignore_eos=True))
    await client.send(wid, req)
    chunks = (await client.until_finished({req.request_id}))[req.request_id]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum(len(c.token_ids) for c in chunks) == 12
    last = chunks[-1]
    assert last.finish_reason == "length" and last.worker_id == wid
    assert last.usage is not None and last.usage.prompt_tokens == 200 and last.usage.completion_tokens == 12


async def test_same_prompt_twice_reports_cached_tokens(env: tuple[Harness, Client]) -> None:
    h, client = env
    w = await h.add_worker(block_size=64)
    wid = w.worker.settings.worker_id
    prompt = list(range(1000, 1300))  # 4 full blocks of 64
    first = client.request(prompt, max_tokens=4)
    await client.send(wid, first)
    await client.until_finished({first.request_id})
    second = client.request(prompt, max_tokens=4)
    await client.send(wid, second)
    chunks = (await client.until_finished({second.request_id}))[second.request_id]
    usage = chunks[-1].usage
    assert usage is not None and usage.cached_tokens == 256


async def test_cancel_aborts_in_engine(env: tuple[Harness, Client]) -> None:
    h, client = env
    w = await h.add_worker(speedup=1.0)  # real-time steps, so the request is still running when cancelled
    wid = w.worker.settings.worker_id
    req = client.request(list(range(50)), max_tokens=2000, sampling=SamplingParams(ignore_eos=True))
    await client.send(wid, req)
    early = await client.first_tokens(req.request_id)  # the engine is running it
    assert w.worker.engine.stats().running == 1
    await client.send(wid, Cancel(req.request_id))
    chunks = early + (await client.until_finished({req.request_id}))[req.request_id]
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 2000
    assert w.worker.engine.stats().running == 0
    assert w.worker.engine.stats().kv_usage == 0.0


async def test_expired_request_is_skipped_and_redelivery_is_ignored(env: tuple[Harness, Client]) -> None:
    h, client = env
    w = await h.add_worker()
    wid = w.worker.settings.worker_id
    stale = client.request([1, 2, 3], deadline=time.time() - 1)
    fresh = client.request([1, 2, 3], max_tokens=3)
    await client.send(wid, stale)
    await client.send(wid, fresh)
    await client.send(wid, fresh)  # delivered twice while running: served once
    out = await client.until_finished({fresh.request_id})
    finals = [c for c in out[fresh.request_id] if c.finish_reason is not None]
    assert len(finals) == 1
    # The stale request produced nothing: its id never shows up among the replies.
    batches = await client.consumer.getmany(timeout_ms=300)
    replies = [c for rs in batches.values() for r in rs for c in chunks_of(reply_decoder.decode(r.value))]
    assert all(c.request_id != stale.request_id for c in replies)


async def test_drain_finishes_in_flight_then_leaves_registry(
    env: tuple[Harness, Client], redis_url: str, prefix: str
) -> None:
    h, client = env
    w = await h.add_worker(speedup=1.0)  # real-time steps: ~60 tokens take a few hundred ms
    wid = w.worker.settings.worker_id
    req = client.request(list(range(64)), max_tokens=60, sampling=SamplingParams(ignore_eos=True))
    await client.send(wid, req)
    early = await client.first_tokens(req.request_id)
    assert early[-1].finish_reason is None  # still running when the drain starts
    code = await w.stop()
    assert code == 0
    chunks = early + (await client.until_finished({req.request_id}))[req.request_id]
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 60
    redis = aioredis.from_url(redis_url)
    live, _ = await Registry(redis, RedisKeys(prefix)).snapshot()
    assert wid not in {x.worker_id for x in live}
    await redis.aclose()


async def test_cancel_right_behind_its_request_is_honoured(env: tuple[Harness, Client]) -> None:
    """A client gone at once: the Cancel arrives in the same fetch as its request, before the engine has it."""
    h, client = env
    w = await h.add_worker(speedup=1.0)
    wid = w.worker.settings.worker_id
    req = client.request(list(range(50)), max_tokens=2000, sampling=SamplingParams(ignore_eos=True))
    # Both queued before either is sent: one produce batch, one fetch on the worker.
    await asyncio.gather(
        await client.producer.send(request_topic(wid), request_encoder.encode(req), key=b"k"),
        await client.producer.send(
            request_topic(wid), request_encoder.encode(Cancel(req.request_id)), key=b"k"
        ),
    )
    chunks = (await client.until_finished({req.request_id}))[req.request_id]
    assert chunks[-1].finish_reason == "abort"
    assert sum(len(c.token_ids) for c in chunks) < 2000
    assert w.worker.engine.stats().running == 0
