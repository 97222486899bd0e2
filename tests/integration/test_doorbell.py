"""Doorbells (bus/doorbell.py): an idle reader sleeps with its partitions paused until a writer rings, on the
real broker and Redis; without a subscription it polls as before."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from aiokafka import TopicPartition
from redis.asyncio import Redis

from bus.doorbell import Doorbell
from bus.read_spec import Hooks, Options, Poll, Tail
from bus.reader import Reader
from kvstore.bells import Bells, BellSubscription
from kvstore.connect import redis_client
from launch.services import free_port, restart_redis, start_redis
from schemas.kafka import LoraAck, request_encoder
from schemas.names import RedisKeys
from server.lora_admin import AckInbox
from tests.harness import Harness, until
from tests.integration.test_bus_reader import Collected, chunk, chunk_decoder, producing, topic_name

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
# Far longer than any wait below: a record read within them was read because of the ring.
FALLBACK_MS = 60_000


def sleeping_reader(kafka: str, bell: Doorbell, seen: Collected) -> Reader:
    return Reader(
        "test", kafka, chunk_decoder, Options(fetch_wait_ms=5, poll=Poll(FALLBACK_MS, 64)), Hooks(seen.handle), bell
    )


async def asleep(reader: Reader, tp: TopicPartition) -> None:
    """Wait until the reader sleeps: its partition paused, so its fetcher sends nothing."""
    await until(lambda: _paused(reader, tp), 10, 0.01)


async def _paused(reader: Reader, tp: TopicPartition) -> bool:
    return reader.sleeps > 0 and tp in reader.consumer.paused()


@dataclass
class Rung:
    """A reader of a fresh topic sleeping on worker "w1"'s bell, and what the test needs around it."""

    topic: str
    keys: RedisKeys
    reader: Reader
    subscription: BellSubscription
    seen: Collected
    redis: Redis


@contextlib.asynccontextmanager
async def rung_reader(kafka: str, redis_url: str, prefix: str) -> AsyncIterator[Rung]:
    """Start a reader with a doorbell subscribed to "w1"'s channel; stop everything after the test."""
    topic, keys = topic_name(), RedisKeys(prefix)
    bell = Doorbell()
    subscription = BellSubscription(redis_url, keys.bell("w1"), "test", bell)
    seen = Collected()
    reader = sleeping_reader(kafka, bell, seen)
    redis = redis_client(redis_url)
    subscription.start()
    await reader.start(Tail(topic))
    try:
        yield Rung(topic, keys, reader, subscription, seen, redis)
    finally:
        await reader.stop()
        await subscription.stop()
        await redis.aclose()


async def test_an_idle_reader_sleeps_until_a_writer_rings(kafka: str, redis_url: str, prefix: str) -> None:
    async with rung_reader(kafka, redis_url, prefix) as r, producing(kafka) as send:
        tp = TopicPartition(r.topic, 0)
        for n in range(3):  # asleep, rung, read, asleep again
            await asleep(r.reader, tp)
            slept = r.reader.sleeps
            await send(r.topic, chunk(n))
            await Bells(r.redis, r.keys).ring("w1")
            await r.seen.until(n + 1)
            assert r.reader.sleeps == slept  # woken by the ring, long before its fallback poll
        assert r.seen.seqs == [0, 1, 2]
        assert r.subscription.rings == 3


async def test_a_sleeping_readers_fetch_routine_stays_parked(kafka: str, redis_url: str, prefix: str) -> None:
    # aiokafka's fetch routine looks at its partitions on every event and, by default, every 200 ms besides:
    # five wake-ups a second for each sleeping reader of an idle fleet. Ferry's consumers wait for events.
    async with rung_reader(kafka, redis_url, prefix) as r, producing(kafka) as send:
        tp = TopicPartition(r.topic, 0)
        await asleep(r.reader, tp)
        fetcher = r.reader.consumer._fetcher
        looks = 0
        look = fetcher._get_actions_per_node

        def counted(assignment: object) -> object:
            nonlocal looks
            looks += 1
            return look(assignment)

        fetcher._get_actions_per_node = counted
        await asyncio.sleep(1.5)  # a window in which nothing happens: what is measured is the routine idling
        assert looks <= 1, looks
        # An event still wakes it at once: the ring resumes the partition, and the record is read.
        await send(r.topic, chunk(0))
        await Bells(r.redis, r.keys).ring("w1")
        await r.seen.until(1)
        assert looks >= 2


async def test_a_ring_for_another_reader_does_not_wake_this_one_and_finish_does(
    kafka: str, redis_url: str, prefix: str
) -> None:
    async with rung_reader(kafka, redis_url, prefix) as r:
        topic, keys, reader, subscription, seen, redis = r.topic, r.keys, r.reader, r.subscription, r.seen, r.redis
        tp = TopicPartition(topic, 0)
        await asleep(reader, tp)
        async with producing(kafka) as send:
            await send(topic, chunk(0))
        other = Doorbell()
        listener = BellSubscription(redis_url, keys.bell("w2"), "other", other)  # hears w2's rings
        listener.start()
        await until(lambda: _armed(other), 10, 0.01)
        await Bells(redis, keys).ring("w2")
        await until(lambda: _heard(listener), 10, 0.01)
        await listener.stop()
        assert subscription.rings == 0 and tp in reader.consumer.paused() and not seen.batches
        # A draining owner's `finished` wakes the loop for one last poll, which reads what is there.
        assert await reader.finished(10)
        assert seen.seqs == [0]


async def _armed(bell: Doorbell) -> bool:
    return bell.armed


async def _heard(subscription: BellSubscription) -> bool:
    return subscription.rings > 0


async def test_without_its_redis_subscription_a_reader_polls(kafka: str) -> None:
    topic = topic_name()
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    bell = Doorbell()
    subscription = BellSubscription(dead, "ferry:bell:nobody", "test", bell)
    seen = Collected()
    reader = sleeping_reader(kafka, bell, seen)
    subscription.start()
    await reader.start(Tail(topic))
    try:
        async with producing(kafka) as send:
            await send(topic, chunk(0))
            await seen.until(1)  # no ring: read by polling, long before the fallback
        assert not bell.armed and reader.sleeps == 0
    finally:
        await reader.stop()
        await subscription.stop()


async def test_an_idle_worker_sleeps_and_a_frontend_rings_it_per_request(h: Harness) -> None:
    running = await h.add_worker()
    quiet = await h.add_worker(doorbell=False)
    fe, url = await h.add_frontend(router_policy="round_robin")
    inbox = running.worker._inbox
    assert inbox.doorbell is not None and quiet.worker._inbox.doorbell is None
    topic = TopicPartition(inbox.topics.current(running.worker.settings.worker_id), 0)
    await asleep(inbox.reader, topic)
    replies = fe.svc.demux.reader
    await until(lambda: _sleeping(replies), 10, 0.01)  # no stream open: nothing to read
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for _ in range(4):  # two each, round robin
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert inbox.bell_subscription is not None and inbox.bell_subscription.rings >= 2
    assert quiet.worker._inbox.reader.sleeps == 0  # --no-doorbell: polls however idle
    assert running.worker.metrics.registry.get_sample_value("ferry_worker_inbox_doorbell") == 1.0
    assert quiet.worker.metrics.registry.get_sample_value("ferry_worker_inbox_doorbell") == 0.0


async def _sleeping(reader: Reader) -> bool:
    return reader.sleeps > 0 and bool(reader.consumer.assignment()) and reader.consumer.assignment() <= reader.consumer.paused()


def test_channels_are_per_worker_under_the_prefix() -> None:
    keys = RedisKeys(f"t{uuid.uuid4().hex[:4]}:")
    assert keys.bell("a") != keys.bell("b") and keys.bell("a").startswith(keys.prefix)


async def test_the_first_ring_after_an_empty_redis_restart_arrives() -> None:
    """A restart closes the ringer's pooled connection; its next ring goes out on a new one instead of being
    lost (a lost ring leaves a sleeping inbox with a request for its whole fallback poll)."""
    child, url = await start_redis()
    client, listener = redis_client(url), None
    keys = RedisKeys(f"bell{uuid.uuid4().hex[:6]}:")
    bells = Bells(client, keys)
    try:
        await bells.ring("w1")  # the pooled connection the restart will close
        await child.stop()
        child = await restart_redis(url)
        listener = redis_client(url)
        pubsub = listener.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(keys.bell("w1"))
        await pubsub.get_message(timeout=5)  # the subscription's confirmation, which it answers as None
        await bells.ring("w1")
        assert await pubsub.get_message(timeout=5) is not None
        await pubsub.aclose()
    finally:
        await client.aclose()
        if listener is not None:
            await listener.aclose()
        await child.stop()


async def test_the_admin_ack_reader_sleeps_until_an_operation_waits(kafka: str) -> None:
    inbox = AckInbox(kafka, topic_name(), fetch_wait_ms=5)
    await inbox.start()
    try:
        reader = inbox._reader
        await until(lambda: _sleeping(reader), 10, 0.01)  # no operation: no ack can matter
        box = inbox.expect("op-1")
        async with producing(kafka) as send:
            await send(inbox.topic, request_encoder.encode(LoraAck("op-1", "w1", "a")))
            async with asyncio.timeout(10):
                assert (await box.get()).op_id == "op-1"
        inbox.forget("op-1")
        slept = reader.sleeps
        await until(lambda: _slept_again(reader, slept), 10, 0.01)
    finally:
        await inbox.stop()


async def _slept_again(reader: Reader, before: int) -> bool:
    return reader.sleeps > before
