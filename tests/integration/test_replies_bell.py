"""A frontend's replies reader sleeps while a stream waits for its next chunk, and the worker that writes it rings
it (server/reply_bell.py, workers/reply_bells.py): on the real broker and Redis, with the sleep's fallback poll
far longer than any wait here, so a chunk read in time was read because of a ring."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
from aiokafka import TopicPartition

from bus.doorbell import SparseRecords
from bus.read_spec import Poll
from kvstore.bells import Bells, BellSubscription
from kvstore.connect import redis_client
from launch.services import free_port
from schemas.kafka import Chunk, request_encoder
from schemas.names import RedisKeys
from server import kafka_io
from server.kafka_io import ReplyDemux
from server.reply_bell import RepliesBell
from tests.harness import Harness, until
from tests.integration.test_bus_reader import producing
from tests.integration.test_reply_roll import delivered, stream_of
from workers.reply_bells import ReplyBells

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
FALLBACK = Poll(60_000, kafka_io.REPLIES_MAX_RECORDS)


@pytest.fixture(autouse=True)
def long_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sleeping reader with a stream open would poll only after a minute."""
    monkeypatch.setattr(kafka_io, "_OPEN_POLL", FALLBACK)


@dataclass
class Rig:
    """A demux rung by a worker's ReplyBells, whose notices the test may hold back (`held`)."""

    demux: ReplyDemux
    bell: RepliesBell
    worker: ReplyBells
    held: list[bytes]
    hold: bool = False


@contextlib.asynccontextmanager
async def rig(kafka: str, redis_url: str, prefix: str) -> AsyncIterator[Rig]:
    keys = RedisKeys(prefix)
    client = redis_client(redis_url)
    bells = Bells(client, keys)
    bell = RepliesBell(redis_url, keys, f"fe-{uuid.uuid4().hex[:6]}", bells)
    demux = ReplyDemux(kafka, f"test.replies.{uuid.uuid4().hex[:8]}", fetch_wait_ms=5, workers_bell=bell)
    worker = ReplyBells(bells.publish_soon)
    r = Rig(demux, bell, worker, [])

    def heard(payload: bytes) -> None:
        if r.hold:
            r.held.append(payload)
        else:
            worker.heard(payload)

    class _Quiet:
        armed = False

        def ring(self) -> None:
            pass

    listener = BellSubscription(redis_url, "unused", "worker", _Quiet(), {keys.replies_asleep(): heard})
    listener.start()
    await demux.start()
    try:
        await until(lambda: _subscribed(bell, listener), 10, 0.01)
        yield r
    finally:
        await demux.stop()
        await listener.stop()
        await client.aclose()


async def _subscribed(bell: RepliesBell, listener: BellSubscription) -> bool:
    return bell.armed and listener._bell.armed


async def asleep_with_notice(r: Rig, announced: int) -> None:
    """Wait until the reader sleeps with its partition paused, after its `announced`-th notice."""
    await until(lambda: _asleep(r, announced), 10, 0.01)


async def _asleep(r: Rig, announced: int) -> bool:
    return (
        r.bell.announced >= announced and TopicPartition(r.demux.topic, 0) in r.demux.reader.consumer.paused()
    )


def reply(seq: int) -> bytes:
    return request_encoder.encode(Chunk("r.0", seq, token_ids=[seq]))


async def test_a_worker_rings_once_its_record_lies_past_the_notice(
    kafka: str, redis_url: str, prefix: str
) -> None:
    async with rig(kafka, redis_url, prefix) as r, producing(kafka) as send:
        stream = stream_of("r")
        r.demux.register(stream)
        for seq in range(3):
            await asleep_with_notice(r, seq + 1)  # the stream is open, and nothing came for a while
            r.worker.acked(r.demux.topic, await send(r.demux.topic, reply(seq)))
            assert await delivered(stream, 1) == [seq]
        assert r.worker.rung == 3 and r.bell.rings >= 3


async def test_records_an_engine_step_apart_are_read_without_an_empty_poll_each(
    kafka: str, redis_url: str, prefix: str
) -> None:
    """The brief poll after each record finds nothing when records come a step apart: after two such polls the
    reader sleeps as soon as it has read, and every record is still read on its ring."""
    async with rig(kafka, redis_url, prefix) as r, producing(kafka) as send:
        stream = stream_of("r")
        r.demux.register(stream)
        await asleep_with_notice(r, 1)
        empty = r.demux.reader.empty_polls
        for seq in range(8):
            await asleep_with_notice(r, seq + 1)
            await asyncio.sleep(0.03)  # an engine step between tokens (a ring within the brief poll's span
            # would say records follow closely)
            r.worker.acked(r.demux.topic, await send(r.demux.topic, reply(seq)))
            assert await delivered(stream, 1) == [seq]
        assert r.demux.reader.empty_polls - empty <= SparseRecords.EMPTY_TAILS + 1  # 8 without
        assert r.worker.rung == 8


async def test_a_record_acknowledged_before_the_notice_reached_the_worker_is_rung_for(
    kafka: str, redis_url: str, prefix: str
) -> None:
    async with rig(kafka, redis_url, prefix) as r, producing(kafka) as send:
        stream = stream_of("r")
        r.hold = True
        r.demux.register(stream)
        await asleep_with_notice(r, 1)
        await until(lambda: _held(r), 10, 0.01)
        # The record is in before the worker hears that the reader sleeps: no ring yet ...
        r.worker.acked(r.demux.topic, await send(r.demux.topic, reply(0)))
        assert r.worker.rung == 0
        # ... and the notice, when it comes, says the reader stopped before it.
        r.hold = False
        r.worker.heard(r.held.pop())
        assert await delivered(stream, 1) == [0]
        assert r.worker.rung == 1


async def _held(r: Rig) -> bool:
    return bool(r.held)


async def test_without_its_subscription_the_reader_polls_while_a_stream_is_open(
    kafka: str, prefix: str
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    keys = RedisKeys(prefix)
    client = redis_client(dead)
    bell = RepliesBell(dead, keys, "fe", Bells(client, keys))
    demux = ReplyDemux(kafka, f"test.replies.{uuid.uuid4().hex[:8]}", fetch_wait_ms=5, workers_bell=bell)
    await demux.start()
    try:
        async with producing(kafka) as send:
            stream = stream_of("r")
            demux.register(stream)
            sleeps = demux.reader.sleeps
            # Long enough for many empty polls, after each of which a reader that may sleep would: with the minute's
            # fallback, the record below would then not be read in time.
            await asyncio.sleep(0.2)
            await send(demux.topic, reply(0))
            assert await delivered(stream, 1) == [0]  # read by polling: no ring can come
        assert not bell.armed and bell.announced == 0 and demux.reader.sleeps == sleeps
    finally:
        await demux.stop()
        await client.aclose()


async def test_a_stream_with_slow_tokens_is_read_on_the_workers_rings(h: Harness) -> None:
    running = await h.add_worker(speedup=0.2)  # ~30 ms decode steps: the reader sleeps between tokens
    fe, url = await h.add_frontend()
    bell = fe.svc.demux.workers_bell
    assert bell is not None and running.worker.reply_bells is not None
    await until(lambda: _armed(bell), 10, 0.01)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 12, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            text = "".join([line async for line in r.aiter_lines()])
    assert text.count('"text"') >= 12 and text.endswith("[DONE]")
    assert bell.announced >= 3 and running.worker.reply_bells.rung >= 3 and bell.rings >= 3
    assert fe.metrics.registry.get_sample_value("ferry_replies_doorbell") == 1.0
    polling, _ = await h.add_frontend(doorbell=False)
    assert polling.svc.demux.workers_bell is None
    assert polling.metrics.registry.get_sample_value("ferry_replies_doorbell") == 0.0


async def _armed(bell: RepliesBell) -> bool:
    return bell.armed
