"""A worker's outbox: one record per topic's consecutive chunks in a round, and rounds no closer than the linger."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka.structs import RecordMetadata, TopicPartition

from schemas.kafka import (
    Chunk,
    Chunks,
    GenerateRequest,
    KVFrom,
    Release,
    chunks_of,
    reply_decoder,
    request_encoder,
)
from workers.metrics import WorkerMetrics
from workers.outbox import MAX_CHUNKS_PER_RECORD, Outbox, Outgoing, Reply, records


def reply(topic: str, rid: str, seq: int) -> Reply:
    return Reply(topic, Chunk(rid, seq, token_ids=[seq], text=f"t{seq}"))


def decoded(out: Outgoing) -> list[tuple[str, int]]:
    return [(c.request_id, c.seq) for c in chunks_of(reply_decoder.decode(out.value))]


def test_a_topics_chunks_share_one_record_in_order() -> None:
    items = [reply("fa", "r1", 0), reply("fb", "r2", 0), reply("fa", "r3", 0), reply("fa", "r1", 1)]
    out = records(list(items))
    assert [o.topic for o in out] == ["fa", "fb"]
    assert decoded(out[0]) == [("r1", 0), ("r3", 0), ("r1", 1)]
    assert isinstance(reply_decoder.decode(out[0].value), Chunks) and out[0].key is None
    # A lone chunk stays a plain Chunk record keyed by its request, as a reader of old records expects.
    assert isinstance(reply_decoder.decode(out[1].value), Chunk) and out[1].key == b"r2"


def test_a_ready_record_for_a_topic_goes_after_what_was_queued_before_it() -> None:
    resend = Outgoing("fa", b"r1", request_encoder.encode(Chunk("r1", 0)), tries=1)
    out = records([reply("fa", "r1", 1), resend, reply("fa", "r1", 2), reply("fb", "r9", 0)])
    assert [(o.topic, decoded(o)) for o in out] == [
        ("fa", [("r1", 1)]),
        ("fa", [("r1", 0)]),
        ("fa", [("r1", 2)]),
        ("fb", [("r9", 0)]),
    ]


def test_records_are_capped() -> None:
    n = MAX_CHUNKS_PER_RECORD * 2 + 1
    out = records([reply("fa", f"r{i}", 0) for i in range(n)])
    assert [len(decoded(o)) for o in out] == [MAX_CHUNKS_PER_RECORD, MAX_CHUNKS_PER_RECORD, 1]
    assert [rid for o in out for rid, _ in decoded(o)] == [f"r{i}" for i in range(n)]


class _Producer:
    """Takes each record at once and acknowledges it; `sent` has (loop time, topic, decoded chunks)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str, list[tuple[str, int]]]] = []
        self.arrived = asyncio.Event()

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int = 0
    ) -> asyncio.Future[Any]:
        replies = not topic.startswith("ferry.requests.")  # a release goes to another worker
        chunks = [(c.request_id, c.seq) for c in chunks_of(reply_decoder.decode(value))] if replies else []
        self.sent.append((asyncio.get_running_loop().time(), topic, chunks))
        self.arrived.set()
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(RecordMetadata(topic, 0, TopicPartition(topic, 0), len(self.sent), 0, 0, 0))
        return done

    async def records(self, n: int) -> None:
        while len(self.sent) < n:
            self.arrived.clear()
            async with asyncio.timeout(5):
                await self.arrived.wait()


def request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid, "m", [1, 2], max_tokens=8, reply_topic="fa")


@contextlib.asynccontextmanager
async def running(linger_s: float) -> AsyncIterator[tuple[Outbox, _Producer]]:
    producer = _Producer()
    outbox = Outbox(producer, WorkerMetrics(), linger_s)  # type: ignore[arg-type]
    task = asyncio.create_task(outbox.run())
    try:
        yield outbox, producer
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_chunks_queued_within_the_linger_go_out_together_after_it() -> None:
    linger = 0.05
    async with running(linger) as (outbox, producer):
        outbox.put(request("r1"), Chunk("r1", 0))
        await producer.records(1)  # nothing went out before it: no wait
        for seq in (1, 2, 3):
            outbox.put(request("r1"), Chunk("r1", seq))
            await asyncio.sleep(0)
        await producer.records(2)
    (first_at, _, first), (then_at, topic, rest) = producer.sent
    assert first == [("r1", 0)] and (topic, rest) == ("fa", [("r1", 1), ("r1", 2), ("r1", 3)])
    assert then_at - first_at >= linger * 0.99  # the loop's timers may fire a hair early


async def test_an_urgent_chunk_ends_the_linger_and_takes_what_waited_with_it() -> None:
    async with running(60.0) as (outbox, producer):
        outbox.put(request("r1"), Chunk("r1", 0))
        await producer.records(1)
        outbox.put(request("r1"), Chunk("r1", 1))
        await asyncio.sleep(0.01)
        assert len(producer.sent) == 1  # lingering (60 s)
        outbox.put(request("r2"), Chunk("r2", 0), urgent=True)  # r2's first token
        await producer.records(2)  # long before the linger would end
    assert producer.sent[1][2] == [("r1", 1), ("r2", 0)]


async def test_a_release_for_another_worker_does_not_linger() -> None:
    async with running(60.0) as (outbox, producer):
        outbox.put(request("r1"), Chunk("r1", 0))
        await producer.records(1)
        kv_from = KVFrom("p", 2, None)
        outbox.put_request("ferry.requests.d", Release("r3", 2, Chunk("r3", 0), kv_from))
        await producer.records(2)
    assert producer.sent[1][1] == "ferry.requests.d"
