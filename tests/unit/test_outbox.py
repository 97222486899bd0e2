"""A worker's outbox: one record per topic's consecutive chunks in a round, a sequence's chunks in it joined into
one, and rounds no closer than the linger."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiokafka.structs import RecordMetadata, TopicPartition

from schemas.kafka import (
    Chunk,
    Chunks,
    ChunkUsage,
    ErrorInfo,
    GenerateRequest,
    KVFrom,
    Release,
    TokenLogprob,
    chunks_of,
    reply_decoder,
    request_encoder,
)
from workers.metrics import WorkerMetrics
from workers.outbox import MAX_CHUNKS_PER_RECORD, Outbox, Outgoing, Reply, joined, records


def reply(topic: str, rid: str, seq: int) -> Reply:
    return Reply(topic, Chunk(rid, seq, token_ids=[seq], text=f"t{seq}"))


def decoded(out: Outgoing) -> list[tuple[str, int, int]]:
    return [(c.request_id, c.seq, c.span) for c in chunks_of(reply_decoder.decode(out.value))]


def test_a_topics_chunks_share_one_record_in_order() -> None:
    items = [reply("fa", "r1", 0), reply("fb", "r2", 0), reply("fa", "r3", 0), reply("fa", "r4", 0)]
    out = records(list(items))
    assert [o.topic for o in out] == ["fa", "fb"]
    assert decoded(out[0]) == [("r1", 0, 1), ("r3", 0, 1), ("r4", 0, 1)]
    assert isinstance(reply_decoder.decode(out[0].value), Chunks) and out[0].key is None
    # A lone chunk stays a plain Chunk record keyed by its request, as a reader of old records expects.
    assert isinstance(reply_decoder.decode(out[1].value), Chunk) and out[1].key == b"r2"


def test_a_ready_record_for_a_topic_goes_after_what_was_queued_before_it() -> None:
    resend = Outgoing("fa", b"r1", request_encoder.encode(Chunk("r1", 0)), tries=1)
    out = records([reply("fa", "r1", 1), resend, reply("fa", "r1", 2), reply("fb", "r9", 0)])
    assert [(o.topic, decoded(o)) for o in out] == [
        ("fa", [("r1", 1, 1)]),
        ("fa", [("r1", 0, 1)]),
        ("fa", [("r1", 2, 1)]),
        ("fb", [("r9", 0, 1)]),
    ]


def test_records_are_capped() -> None:
    n = MAX_CHUNKS_PER_RECORD * 2 + 1
    out = records([reply("fa", f"r{i}", 0) for i in range(n)])
    assert [len(decoded(o)) for o in out] == [MAX_CHUNKS_PER_RECORD, MAX_CHUNKS_PER_RECORD, 1]
    assert [rid for o in out for rid, _, _ in decoded(o)] == [f"r{i}" for i in range(n)]
    # A joined chunk counts as the chunks it carries: a record holds no more tokens than before.
    out = records([reply("fa", "r1", i) for i in range(n)])
    assert [decoded(o) for o in out] == [
        [("r1", 0, MAX_CHUNKS_PER_RECORD)],
        [("r1", MAX_CHUNKS_PER_RECORD, MAX_CHUNKS_PER_RECORD)],
        [("r1", 2 * MAX_CHUNKS_PER_RECORD, 1)],
    ]


def test_a_sequences_chunks_in_a_record_are_joined_into_one_where_its_first_was() -> None:
    lp = [TokenLogprob(7, -0.5)]
    usage = ChunkUsage(3, 3)
    chunks = [
        Chunk("r1", 0, [10], "a", logprobs=lp, prompt_logprobs=[None], worker_id="w"),
        Chunk("r2", 4, [20], "x", worker_id="w"),
        Chunk("r1", 1, [11], "b", logprobs=lp, worker_id="w"),
        Chunk("r2", 5, [21], "y", worker_id="w"),
        Chunk("r1", 2, [12], "c", "stop", "!", usage, logprobs=lp, worker_id="w"),
    ]
    r1, r2 = joined(chunks)
    assert r1 == Chunk(
        "r1", 0, [10, 11, 12], "abc", "stop", "!", usage, logprobs=lp * 3, prompt_logprobs=[None], worker_id="w", span=3
    )
    assert (r2.seq, r2.span, r2.token_ids, r2.text, r2.end) == (4, 2, [20, 21], "xy", 6)
    # Through a record and back, as the frontend reads it.
    (record,) = records([Reply("fa", c) for c in chunks])
    assert chunks_of(reply_decoder.decode(record.value)) == [r1, r2]
    lone = [Chunk("r1", 0, [1]), Chunk("r2", 0, [2])]
    assert joined(lone) is lone


def test_chunks_that_must_stay_apart_do() -> None:
    err = ErrorInfo("engine_dead", "gone", retriable=True)
    chunks = [
        Chunk("a", 0, [1]),
        Chunk("a", 1, finish_reason="error", error=err),  # an error: apart
        Chunk("b", 0, [1], finish_reason="length"),
        Chunk("b", 1, [2]),  # after an ending: apart
        Chunk("c", 0, [1]),
        Chunk("c", 2, [3]),  # not the next one: apart
        Chunk("d", 3, [1]),
        Chunk("d", 3, [1], attempt=1),  # another attempt: its own run, after the first
        Chunk("d", 4, [2], attempt=1),
        Chunk("e", 0, [1]),
        Chunk("e", 1, [2], prompt_logprobs=[None]),  # a head: apart
    ]
    assert [(c.request_id, c.seq, c.attempt, c.span) for c in joined(chunks)] == [
        ("a", 0, 0, 1), ("a", 1, 0, 1), ("b", 0, 0, 1), ("b", 1, 0, 1), ("c", 0, 0, 1), ("c", 2, 0, 1),
        ("d", 3, 0, 1), ("d", 3, 1, 2), ("e", 0, 0, 1), ("e", 1, 0, 1),
    ]  # fmt: skip


class _Producer:
    """Takes each record at once and acknowledges it; `sent` has (loop time, topic, decoded chunks)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, str, list[tuple[str, int, int]]]] = []
        self.arrived = asyncio.Event()

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, partition: int = 0
    ) -> asyncio.Future[Any]:
        replies = not topic.startswith("ferry.requests.")  # a release goes to another worker
        chunks = [(c.request_id, c.seq, c.span) for c in chunks_of(reply_decoder.decode(value))] if replies else []
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
    assert first == [("r1", 0, 1)] and (topic, rest) == ("fa", [("r1", 1, 3)])
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
    assert producer.sent[1][2] == [("r1", 1, 1), ("r2", 0, 1)]


async def test_a_release_for_another_worker_does_not_linger() -> None:
    async with running(60.0) as (outbox, producer):
        outbox.put(request("r1"), Chunk("r1", 0))
        await producer.records(1)
        kv_from = KVFrom("p", 2, None)
        outbox.put_request("ferry.requests.d", Release("r3", 2, Chunk("r3", 0), kv_from))
        await producer.records(2)
    assert producer.sent[1][1] == "ferry.requests.d"
