"""Does a fetch of the embedded broker skip record batches, and does a `Reader` hand on the holes?

Starts the embedded broker (Tansu 0.6, in-memory storage), has 5 producers write small batches (of 1, 3,
8, 2 and 5 records) to one partition for `--seconds` while one `Reader` reads it from the start with the
token path's 5 ms fetch wait, and reports the holes the reader read again (fetches that skipped records:
broker quirk "fetch skips a batch" in docs/architecture.md), the holes it read on past after `GAP_TRIES`
reads, and the holes its handler saw (records handed on out of sequence; 0 is the point).
Run: `.venv/bin/python -m bench.tansu_gap [--seconds 150]`.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

from aiokafka import AIOKafkaProducer, TopicPartition

from bench.stack import run_cleanly
from bus.read_spec import At, Batch, Hooks, Options, Poll
from bus.reader import Reader
from bus.topics import ensure_topics
from launch.services import start_broker

BATCH_SIZES = (1, 3, 8, 2, 5)


class Raw:
    """Decodes nothing: the value is the message."""

    def decode(self, buf: bytes, /) -> bytes:
        """The value itself."""
        return buf


async def produce(boot: str, topic: str, stop: asyncio.Event, n: int) -> None:
    """Write batches of `n` 200-byte records to partition 0 until `stop`."""
    producer = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=0)
    await producer.start()
    try:
        while not stop.is_set():
            futs = [await producer.send(topic, b"x" * 200, partition=0) for _ in range(n)]
            await asyncio.gather(*futs)
            await asyncio.sleep(0.001)
    finally:
        await producer.stop()


async def probe(boot: str, seconds: float) -> None:
    """One run against the broker at `boot`; prints one line."""
    topic = f"gap-{uuid.uuid4().hex[:6]}"
    await ensure_topics(boot, {topic: 1})
    seen = {"next": 0, "holes": 0, "records": 0}

    async def handle(batch: Batch[bytes]) -> None:
        for record, _ in batch.messages:
            if record.offset != seen["next"]:
                seen["holes"] += 1
                print(f"  hole handed on: expected {seen['next']}, got {record.offset}", flush=True)
            seen["next"] = record.offset + 1
        seen["records"] += len(batch.messages)

    reader = Reader("gap probe", boot, Raw(), Options(fetch_wait_ms=5, poll=Poll(1000, 2048)), Hooks(handle))
    await reader.start(At(topic, 0))
    stop = asyncio.Event()
    producers = [asyncio.create_task(produce(boot, topic, stop, n)) for n in BATCH_SIZES]
    try:
        await asyncio.sleep(seconds)
    finally:
        stop.set()
        await asyncio.gather(*producers, return_exceptions=True)
    tp = TopicPartition(topic, 0)
    for _ in range(100):  # up to 10 s for the reader to catch up
        end = reader.consumer.highwater(tp)
        if end is not None and seen["next"] >= end:
            break
        await asyncio.sleep(0.1)
    end = reader.consumer.highwater(tp)
    await reader.stop()
    print(
        f"{seconds:.0f} s: {seen['records']} records read up to {seen['next']} of {end}; "
        f"holes read again {reader.gaps_refetched}, read past {reader.gaps_accepted}, handed on {seen['holes']}",
        flush=True,
    )


async def main() -> None:
    """Parse arguments, start the broker, probe."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    child, boot = await start_broker(echo=False)
    try:
        for _ in range(args.runs):
            await probe(boot, args.seconds)
    finally:
        await child.stop()


if __name__ == "__main__":
    run_cleanly(main())
