"""The one consumer-loop owner (bus/reader.py): what every reader gets from it, on the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from bus.read_spec import At, Batch, Hooks, Options, Own, Poll, Tail
from bus.reader import Reader
from bus.topics import delete_topics, ensure_topics
from schemas.kafka import Chunk, request_encoder

pytestmark = pytest.mark.integration

Send = Callable[[str, bytes], Awaitable[int]]


@contextlib.asynccontextmanager
async def producing(kafka: str) -> AsyncIterator[Send]:
    """A function that writes one record to partition 0 of a topic and returns its offset."""
    producer = AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=0)
    await producer.start()

    async def send(topic: str, value: bytes) -> int:
        return int((await producer.send_and_wait(topic, value, partition=0)).offset)

    try:
        yield send
    finally:
        await producer.stop()


def chunk(seq: int) -> bytes:
    return request_encoder.encode(Chunk("r.0", seq, token_ids=[seq]))


class Collected:
    """A handler that keeps every batch and lets a test wait for a number of records."""

    def __init__(self) -> None:
        self.batches: list[Batch[Chunk]] = []
        self._arrived = asyncio.Event()

    async def handle(self, batch: Batch[Chunk]) -> None:
        self.batches.append(batch)
        self._arrived.set()

    @property
    def seqs(self) -> list[int]:
        return [c.seq for b in self.batches for _, c in b.messages]

    async def until(self, n_records: int) -> None:
        async with asyncio.timeout(20):
            while sum(len(b.messages) + len(b.dropped) for b in self.batches) < n_records:
                self._arrived.clear()
                await self._arrived.wait()


# These tests write plain Chunk records and read them back as such.
chunk_decoder = msgspec.msgpack.Decoder(Chunk)


def topic_name() -> str:
    return f"test.reader.{uuid.uuid4().hex[:8]}"


async def test_a_reader_hands_decoded_batches_on_and_drops_undecodable_records(kafka: str) -> None:
    topic = topic_name()
    seen = Collected()
    reader = Reader("test", kafka, chunk_decoder, Options(fetch_wait_ms=5), Hooks(seen.handle))
    await reader.start(Tail(topic))  # creates the topic
    try:
        async with producing(kafka) as send:
            for value in (chunk(0), b"\xc1 not msgpack", chunk(1)):
                await send(topic, value)
            await seen.until(3)
        assert seen.seqs == [0, 1]
        assert [r.offset for b in seen.batches for r in b.dropped] == [1]
        assert seen.batches[-1].end == 3
    finally:
        await reader.stop()


async def test_a_reader_that_dies_reports_it_once_and_still_stops(kafka: str) -> None:
    topic = topic_name()
    failures: list[BaseException] = []

    async def broken(batch: Batch[Chunk]) -> None:
        raise RuntimeError("injected")

    reader = Reader(
        "test", kafka, chunk_decoder, Options(fetch_wait_ms=5), Hooks(broken, failed=failures.append)
    )
    await reader.start(Tail(topic))
    async with producing(kafka) as send:
        await send(topic, chunk(0))
    assert reader._task is not None
    await asyncio.wait([reader._task], timeout=20)
    assert isinstance(reader.failed, RuntimeError)
    assert failures == [reader.failed]
    await reader.stop()
    assert not reader.started


async def test_an_error_hook_that_says_go_on_keeps_the_reader(kafka: str) -> None:
    topic = topic_name()
    seen = Collected()
    errors: list[Exception] = []
    errored = asyncio.Event()

    async def once_broken(batch: Batch[Chunk]) -> None:
        if not errors:
            raise RuntimeError("injected")
        await seen.handle(batch)

    async def go_on(exc: Exception) -> bool:
        errors.append(exc)
        errored.set()
        return True

    hooks = Hooks(once_broken, error=go_on)
    reader = Reader("test", kafka, chunk_decoder, Options(fetch_wait_ms=5), hooks)
    await reader.start(Tail(topic))
    try:
        async with producing(kafka) as send:
            await send(topic, chunk(0))
            async with asyncio.timeout(20):
                await errored.wait()
            await send(topic, chunk(1))
            await seen.until(1)
        assert seen.seqs == [1]
        assert reader.failed is None
    finally:
        await reader.stop()


async def test_a_reader_reads_a_log_the_broker_lost_again_from_its_start(kafka: str) -> None:
    topic = topic_name()
    tp = TopicPartition(topic, 0)
    seen = Collected()
    rewound: list[list[TopicPartition]] = []
    noticed = asyncio.Event()

    async def reset(tps: list[TopicPartition]) -> None:
        rewound.append(tps)
        noticed.set()

    options = Options(fetch_wait_ms=5, poll=Poll(200, 256), watch_reset=True)
    reader = Reader("test", kafka, chunk_decoder, options, Hooks(seen.handle, reset=reset))
    await reader.start(Tail(topic))
    try:
        async with producing(kafka) as send:
            for seq in range(3):
                await send(topic, chunk(seq))
            await seen.until(3)
            # The broker loses the log (as Tansu does when it restarts empty): the reader's position lies
            # past the new end, which its next idle poll notices.
            await delete_topics(kafka, [topic])
            await ensure_topics(kafka, {topic: 1})
            async with asyncio.timeout(20):
                await noticed.wait()
            assert rewound == [[tp]]
            assert await send(topic, chunk(7)) == 0
            await seen.until(4)
        assert seen.seqs == [0, 1, 2, 7]
    finally:
        await reader.stop()


async def test_a_reader_of_its_own_partition_commits_after_each_poll_and_resumes_there(kafka: str) -> None:
    topic = topic_name()
    await ensure_topics(kafka, {topic: 1})
    options = Options(
        fetch_wait_ms=5, group_id=f"test-{topic}", offset_reset="earliest", commit_after_poll=True
    )
    async with producing(kafka) as send:
        for seq in range(2):
            await send(topic, chunk(seq))
        first = Collected()
        reader = Reader("test", kafka, chunk_decoder, options, Hooks(first.handle))
        await reader.start(Own(topic))
        try:
            await first.until(2)
        finally:
            await reader.stop()
        await send(topic, chunk(2))
    again = Collected()
    reader = Reader("test", kafka, chunk_decoder, options, Hooks(again.handle))
    await reader.start(Own(topic))
    try:
        await again.until(1)
        assert again.seqs == [2]
    finally:
        await reader.stop()
    assert first.seqs == [0, 1]


async def test_point_lookups_find_a_record_and_know_when_it_is_gone(kafka: str) -> None:
    topic = topic_name()
    tp = TopicPartition(topic, 0)
    await ensure_topics(kafka, {topic: 1})
    lookups = Reader("test", kafka, chunk_decoder, Options(offset_reset="none"))
    await lookups.start()
    try:
        async with producing(kafka) as send:
            await send(topic, chunk(5))
            await send(topic, b"\xc1 not msgpack")
        assert await lookups.read_at(tp, 2, 5.0) is None  # past the log's end
        assert await lookups.read_at(tp, 1, 5.0) is None  # there, but not a message
        found = await lookups.read_at(tp, 0, 5.0)
        assert found is not None and found.seq == 5
    finally:
        await lookups.stop()


async def test_a_reader_from_an_offset_starts_there(kafka: str) -> None:
    topic = topic_name()
    await ensure_topics(kafka, {topic: 1})
    seen = Collected()
    async with producing(kafka) as send:
        for seq in range(4):
            await send(topic, chunk(seq))
    reader = Reader("test", kafka, chunk_decoder, Options(fetch_wait_ms=5), Hooks(seen.handle))
    await reader.start(At(topic, 2))
    try:
        await seen.until(2)
        assert seen.seqs == [2, 3]
    finally:
        await reader.stop()
