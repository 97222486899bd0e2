"""Readers of a long partition on the embedded broker: Tansu answers a fetch with nothing when reading
takes longer than the fetch's wait, so a prompt (5 ms) reader needs FetchWaitAdjuster to get its records."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bus.consumer import stop_consumer
from bus.log_watch import FetchWaitAdjuster
from bus.topics import ensure_topics
from launch.services import BROKER_THREADS, start_broker

pytestmark = pytest.mark.integration

# Enough batches that one read takes Tansu several times a 5 ms fetch wait (~0.7 ms per thousand).
BATCHES = 30_000


async def fill(kafka: str, topic: str, batches: int) -> None:
    """Write `batches` records, each in a batch of its own (what workers' replies look like)."""
    producers = [AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=0) for _ in range(8)]
    for p in producers:
        await p.start()
    try:

        async def one(p: AIOKafkaProducer, n: int) -> None:
            for _ in range(n):
                await p.send_and_wait(topic, b"x" * 100, partition=0)

        await asyncio.gather(*(one(p, batches // len(producers)) for p in producers))
    finally:
        for p in producers:
            await p.stop()


async def test_a_prompt_reader_of_a_long_partition_gets_its_records(kafka: str) -> None:
    topic = f"test.long.{uuid.uuid4().hex[:8]}"
    await ensure_topics(kafka, {topic: 1})
    await fill(kafka, topic, BATCHES)
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False, fetch_max_wait_ms=5)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        end = await consumer.position(tp)
        consumer.seek(tp, end - 200)
        stretch = FetchWaitAdjuster(consumer, "test")
        got: list[int] = []
        async with asyncio.timeout(60):
            while len(got) < 200:
                batches = await consumer.getmany(timeout_ms=300)
                await stretch.after_poll(bool(batches))
                got += [r.offset for records in batches.values() for r in records]
        assert got == list(range(end - 200, end))
        # Caught up: one more poll (idle) and the reader is back at its prompt wait.
        await stretch.after_poll(bool(await consumer.getmany(timeout_ms=300)))
        assert not stretch.stretched
    finally:
        await consumer.stop()


async def test_a_consumer_stopped_while_its_broker_is_away_lets_go_of_it() -> None:
    """aiokafka's stop() raises CancelledError out of its fetcher's retry and leaves the client trying the
    dead broker forever; stop_consumer ends the stop and closes the client."""
    broker, kafka = await start_broker()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False, fetch_max_wait_ms=5)
    try:
        await ensure_topics(kafka, {"away": 1})
        await consumer.start()
        tp = TopicPartition("away", 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        await consumer.getmany(timeout_ms=200)
    finally:
        await broker.stop()
    for _ in range(3):  # fetches fail and back off while the broker is gone
        await consumer.getmany(timeout_ms=300)
    await stop_consumer(consumer)
    sync = consumer._client._sync_task
    assert sync is None or sync.done()


def runtime_threads(pid: int) -> int:
    """Threads of the broker's async runtime (tokio names them so)."""
    return sum(1 for t in Path(f"/proc/{pid}/task").iterdir() if (t / "comm").read_text().strip() == "tokio-rt-worker")


@pytest.mark.parametrize(("env", "threads"), [(None, BROKER_THREADS), ("2", 2)])
async def test_the_embedded_broker_runs_on_one_runtime_thread_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch, env: str | None, threads: int
) -> None:
    if env is None:
        monkeypatch.delenv("TOKIO_WORKER_THREADS", raising=False)
    else:
        monkeypatch.setenv("TOKIO_WORKER_THREADS", env)
    broker, _kafka = await start_broker()
    try:
        assert runtime_threads(broker.proc.pid) == threads
    finally:
        await broker.stop()
