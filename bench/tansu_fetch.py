"""What one fetch that returns data costs the embedded broker, as its partition grows in record batches.

Tansu (0.6, in-memory storage) answers a fetch that returns data in time proportional to the number
of record batches the fetched partition holds; producing, idle fetches and other partitions stay cheap.
This is why frontends roll their replies topics (`--replies-roll-records`, docs/architecture.md).
Run: `.venv/bin/python -m bench.tansu_fetch [--steps 0,10000,20000]`.
"""

from __future__ import annotations

import argparse

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.stack import process_cpu_seconds, run_cleanly
from bus.topics import ensure_topics
from launch.services import Child, start_broker


async def broker_ms_per_round_trip(child: Child, boot: str, producer: AIOKafkaProducer, topic: str, n: int) -> float:
    """Broker CPU (ms) per produce of one record + the fetch that returns it, at the partition's end."""
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False, fetch_max_wait_ms=100)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        before = process_cpu_seconds(child.proc.pid) or 0.0
        for _ in range(n):
            await producer.send_and_wait(topic, b"y" * 200, partition=0)
            while not await consumer.getmany(timeout_ms=1000):
                pass
        return 1000 * ((process_cpu_seconds(child.proc.pid) or 0.0) - before) / n
    finally:
        await consumer.stop()


async def main(steps: list[int], rounds: int) -> None:
    """Grow topic `big` one batch per record and measure round trips on it and on a small topic."""
    child, boot = await start_broker()
    await ensure_topics(boot, {"big": 1, "small": 1})
    # linger 0 and one record at a time: every record is a batch of its own.
    producer = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=0)
    await producer.start()
    try:
        print("| batches in `big` | broker ms per round trip on `big` | on `small` (a few hundred batches) |")
        print("| ---: | ---: | ---: |")
        batches = 0
        for target in steps:
            while batches < target:
                await producer.send_and_wait("big", b"x" * 200, partition=0)
                batches += 1
            big = await broker_ms_per_round_trip(child, boot, producer, "big", rounds)
            small = await broker_ms_per_round_trip(child, boot, producer, "small", rounds)
            batches += rounds
            print(f"| {target:,} | {big:.1f} | {small:.1f} |", flush=True)
    finally:
        await producer.stop()
        await child.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.tansu_fetch", description=__doc__)
    p.add_argument("--steps", default="0,5000,10000,20000,40000", help="partition sizes to measure at")
    p.add_argument("--rounds", type=int, default=50, help="round trips measured at each size")
    a = p.parse_args()
    run_cleanly(main([int(x) for x in a.steps.split(",")], a.rounds))
