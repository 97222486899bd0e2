"""Rolling replies topics: a frontend moves new requests to a fresh topic, reads the old one while its
requests are open, deletes it after the retention, and resumed streams still find their chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaConnectionError

from schemas.kafka import Chunk, request_encoder
from server import kafka_io
from server.kafka_io import ReplyDemux
from server.router import Decision
from server.streams import ClientStream, Sequence
from tests.harness import Harness, sse_events, until

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


def stream_of(rid: str) -> ClientStream:
    s = ClientStream(rid)
    s.sequences[f"{rid}.0"] = Sequence(f"{rid}.0", 0, 0, Decision("w"), 1)
    return s


async def topics(kafka: str) -> set[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def delivered(stream: ClientStream, n: int) -> list[int]:
    """Token ids of the next `n` chunks the demux hands to `stream`."""
    out: list[int] = []
    async with asyncio.timeout(20):
        while len(out) < n:
            out += [t for _seq, chunk in await stream.get(None) for t in chunk.token_ids]
    return out


Reply = Callable[[str, Chunk], Awaitable[None]]


@contextlib.asynccontextmanager
async def demux_rig(
    kafka: str, roll_records: int, retain_s: float
) -> AsyncIterator[tuple[ReplyDemux, Reply, str]]:
    """A started demux, a function that writes one reply chunk to a topic, and the demux's base topic."""
    base = f"test.replies.{uuid.uuid4().hex[:8]}"
    demux = ReplyDemux(kafka, base, fetch_wait_ms=5, roll_records=roll_records, retain_s=retain_s)
    producer = AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=0)
    await producer.start()
    await demux.start()

    async def reply(topic: str, chunk: Chunk) -> None:
        await producer.send_and_wait(topic, request_encoder.encode(chunk), partition=0)

    try:
        yield demux, reply, base
    finally:
        await demux.stop()
        await producer.stop()


def rolled_from(demux: ReplyDemux, topic: str) -> Callable[[], Awaitable[bool]]:
    """A check for `until`: new requests no longer reply to `topic` (read on the demux's task)."""

    async def rolled() -> bool:
        return demux.topic != topic

    return rolled


async def test_demux_rolls_reads_old_topics_while_used_then_deletes_them(kafka: str) -> None:
    async with demux_rig(kafka, roll_records=3, retain_s=0.5) as (demux, reply, base):
        # `old` replies on the first topic and stays open across the rolls its traffic causes.
        old = stream_of("old")
        topic_old, _ = demux.register(old)
        assert topic_old == base
        for i in range(4):
            await reply(topic_old, Chunk("old.0", i, token_ids=[i]))
        assert await delivered(old, 4) == [0, 1, 2, 3]

        await until(rolled_from(demux, base), 20, 0.01)  # after the demux read record 3
        new = stream_of("new")
        topic_new, offset = demux.register(new)
        assert topic_new == f"{base}.1" and offset == 0
        # Both are read: the old topic for `old`, the new one for `new`.
        await reply(topic_new, Chunk("new.0", 0, token_ids=[7]))
        await reply(topic_old, Chunk("old.0", 4, token_ids=[4]))
        assert await delivered(new, 1) == [7]
        assert await delivered(old, 1) == [4]
        assert demux.topics == [base, topic_new]
        # Once `old` is done nothing replies on the first topic: it is dropped, then deleted.
        demux.unregister(old)

        async def deleted() -> bool:
            return base not in await topics(kafka)

        await until(deleted, 30, 0.1)
        assert demux.topics == [topic_new]
        # The current topic keeps delivering after the reassignment.
        await reply(topic_new, Chunk("new.0", 1, token_ids=[8]))
        assert await delivered(new, 1) == [8]


async def test_a_retired_topic_is_deleted_while_replies_keep_arriving(kafka: str) -> None:
    # Under steady load every poll brings records; retired topics must still go when their time is up.
    async with demux_rig(kafka, roll_records=1, retain_s=0.3) as (demux, reply, base):
        await reply(base, Chunk("none.0", 0, token_ids=[0]))
        await until(rolled_from(demux, base), 20, 0.01)
        busy = stream_of("busy")
        topic, _ = demux.register(busy)
        gone = False
        i = 0
        async with asyncio.timeout(30):
            while not gone:
                await reply(topic, Chunk("busy.0", i, token_ids=[i]))
                assert await delivered(busy, 1) == [i]
                i += 1
                gone = base not in await topics(kafka)
        assert base not in demux.topics


async def test_a_topic_no_resumable_stream_used_goes_first(
    kafka: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks nobody can ask for again are not kept for the resume TTL (the broker holds them in memory).
    monkeypatch.setattr(kafka_io, "UNRESUMABLE_RETAIN_S", 0.3)
    async with demux_rig(kafka, roll_records=1, retain_s=60) as (demux, reply, base):
        kept = stream_of("kept")
        assert demux.register(kept, resumable=True)[0] == base
        await reply(base, Chunk("kept.0", 0, token_ids=[0]))
        await until(rolled_from(demux, base), 20, 0.01)
        plain = stream_of("plain")
        topic, _ = demux.register(plain)
        await reply(topic, Chunk("plain.0", 0, token_ids=[1]))
        await until(rolled_from(demux, topic), 20, 0.01)
        demux.unregister(kept)
        demux.unregister(plain)

        async def deleted() -> bool:
            return topic not in await topics(kafka)

        await until(deleted, 30, 0.1)
        # Retired first, deleted last: a resumed stream can still read its chunks back.
        assert base in await topics(kafka)
        assert demux.topics == [demux.topic]


async def test_requests_across_rolls_complete_and_a_stream_resumes_from_its_topic(h: Harness) -> None:
    await h.add_worker(speedup=1.0)  # real time: the resumable stream is still running when dropped
    # A wave of 8 concurrent requests of 30 tokens makes at least 30 records (a worker sends the chunks of
    # the sequences it steps together as one record), so a wave fills a topic of 20.
    fe, url = await h.add_frontend(replies_roll_records=20)
    first = fe.svc.demux.topic
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A long story, please"}],
        "max_tokens": 120,
        "ignore_eos": True,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        events: list[tuple[str | None, str]] = []
        async with c.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-ferry-resumable": "1"}
        ) as r:
            assert r.status_code == 200
            rid = r.headers["x-request-id"]
            async for e in sse_events(r):
                events.append(e)
                if len(events) == 5:
                    break
        # Enough other traffic to roll the replies topic twice while that stream runs on: each wave fills
        # the topic its requests were sent with, and the next wave goes to a fresh one.
        short = {"model": MODEL, "prompt": "Count", "max_tokens": 30, "ignore_eos": True}
        for _wave in range(2):
            answers = await asyncio.gather(*(c.post("/v1/completions", json=short) for _ in range(8)))
            assert [a.status_code for a in answers] == [200] * 8
            assert all(a.json()["usage"]["completion_tokens"] == 30 for a in answers)
        assert fe.svc.demux.topic != first
        assert (fe.metrics.registry.get_sample_value("ferry_reply_topic_rolls_total") or 0) >= 2
        async with c.stream(
            "GET", f"/v1/chat/completions/{rid}/stream", headers={"last-event-id": events[-1][0] or ""}
        ) as r:
            assert r.status_code == 200
            events += [e async for e in sse_events(r)]
    ids = [int(i) for i, _ in events if i is not None]
    assert ids == list(range(len(ids)))
    assert events[-1] == (None, "[DONE]")
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 120


async def test_a_stream_that_ends_while_the_demux_reassigns_does_not_kill_it(kafka: str) -> None:
    # Chaos run: the last stream of a retired topic ended during the reassignment's seek and the
    # demux died ("dictionary changed size during iteration"), failing every open stream.
    async with demux_rig(kafka, roll_records=1, retain_s=60) as (demux, reply, base):
        consumer = demux._reader.consumer
        seek = consumer.seek_to_beginning
        ending: list[ClientStream] = []

        async def seek_while_a_stream_ends(*tps: object) -> None:
            while ending:
                demux.unregister(ending.pop())
            await seek(*tps)  # type: ignore[arg-type]

        consumer.seek_to_beginning = seek_while_a_stream_ends  # type: ignore[method-assign]
        streams = [stream_of(f"s{i}") for i in range(3)]
        for i, s in enumerate(streams):
            topic, _ = demux.register(s)
            await reply(topic, Chunk(f"s{i}.0", 0, token_ids=[i]))
            assert await delivered(s, 1) == [i]

            await until(rolled_from(demux, topic), 20, 0.01)  # one record per topic
        # s0 and s1 hold two old topics open. Rewind the first to 0 (what the demux does when the broker
        # lost its log), so the next reassignment awaits a seek on it; s1 ends during that await.
        demux._tails[base].position = 0
        ending.append(streams[1])
        last = stream_of("last")
        topic, _ = demux.register(last)
        await reply(topic, Chunk("last.0", 0, token_ids=[9]))
        assert await delivered(last, 1) == [9]
        await until(rolled_from(demux, topic), 20, 0.01)
        assert not ending, "the injected end never ran"
        assert demux.failed is None
        # The demux lives on: `last` still gets its chunks from its (now old) topic.
        await reply(topic, Chunk("last.0", 1, token_ids=[10]))
        assert await delivered(last, 1) == [10]


async def test_a_roll_the_broker_refuses_is_tried_again_later(
    kafka: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chaos run: the broker was restarting when the demux wanted a fresh topic, and the admin client's
    # KafkaConnectionError killed the reply consumer. Now it stays on its topic and rolls later.
    real = kafka_io.ensure_topics
    refused: list[str] = []

    async def away_once(
        bootstrap: str, topics: dict[str, int], configs: dict[str, str] | None = None
    ) -> None:
        if not refused:
            refused.extend(topics)
            raise KafkaConnectionError("Unable to bootstrap (injected)")
        await real(bootstrap, topics, configs)

    async with demux_rig(kafka, roll_records=1, retain_s=60) as (demux, reply, base):
        monkeypatch.setattr(kafka_io, "ensure_topics", away_once)
        s = stream_of("s")
        topic, _ = demux.register(s)
        for i in range(2):
            await reply(topic, Chunk("s.0", i, token_ids=[i]))
            assert await delivered(s, 1) == [i]

        await until(rolled_from(demux, base), 20, 0.01)
        assert refused == [f"{base}.1"] and demux.topic == f"{base}.1"
        assert demux.failed is None
