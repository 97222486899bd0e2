"""What the embedded broker frees: DeleteRecords, retention configs, topic deletion.

Fills a topic with single-record batches, then asks the broker (Tansu 0.6, in-memory storage) to trim it
three ways and reports after each whether the call succeeded, the broker's RSS, the partition's start
offset and what a produce + fetch at the end costs the broker.
Run: `.venv/bin/python -m bench.tansu_trim [--records 20000]`.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from bench.stack import process_cpu_seconds, run_cleanly
from bench.tansu_fetch import broker_ms_per_round_trip
from launch.services import Child, start_broker


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def fill(producer: AIOKafkaProducer, topic: str, n: int, size: int) -> None:
    """Produce n records of `size` bytes, one batch each (pipelined 200 at a time)."""
    for start in range(0, n, 200):
        futs = [await producer.send(topic, b"x" * size, partition=0) for _ in range(min(200, n - start))]
        await asyncio.gather(*futs)


async def start_offset(boot: str, topic: str) -> int | None:
    """The partition's first offset as ListOffsets(earliest) answers it."""
    c = AIOKafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False)
    await c.start()
    try:
        tp = TopicPartition(topic, 0)
        return (await c.beginning_offsets([tp]))[tp]
    except Exception as e:
        print(f"  beginning_offsets failed: {e!r}")
        return None
    finally:
        await c.stop()


async def report(child: Child, boot: str, producer: AIOKafkaProducer, topic: str, label: str) -> None:
    """Print RSS, start offset and round-trip cost at the end of the topic."""
    await asyncio.sleep(1)
    ms = await broker_ms_per_round_trip(child, boot, producer, topic, 30)
    start = await start_offset(boot, topic)
    print(
        f"{label:45s} rss {rss_mb(child.proc.pid):7.1f} MB  start offset {start}  {ms:.2f} ms/round trip",
        flush=True,
    )


async def main(records: int, size: int) -> None:
    """Fill, then DeleteRecords, then retention configs, then delete the topic, reporting after each."""
    child, boot = await start_broker()
    admin = AIOKafkaAdminClient(bootstrap_servers=boot)
    await admin.start()
    producer = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=0)
    await producer.start()
    try:
        print(f"broker at start: rss {rss_mb(child.proc.pid):.1f} MB")
        await admin.create_topics(
            [
                NewTopic("t", 1, 1),
                NewTopic(
                    "r",
                    1,
                    1,
                    topic_configs={
                        "retention.ms": "2000",
                        "retention.bytes": "100000",
                        "cleanup.policy": "delete",
                    },
                ),
            ]
        )
        await fill(producer, "t", records, size)
        await report(child, boot, producer, "t", f"after {records} records")

        # 1. DeleteRecords below the end.
        tp = TopicPartition("t", 0)
        t0 = time.monotonic()
        try:
            res = await asyncio.wait_for(admin.delete_records({tp: RecordsToDelete(records - 100)}), 10)
            print(f"  delete_records -> {res} in {time.monotonic() - t0:.2f}s")
        except Exception as e:
            print(f"  delete_records failed after {time.monotonic() - t0:.2f}s: {e!r}")
        await report(child, boot, producer, "t", "after delete_records(end - 100)")

        # 2. Retention configs: set at creation on `r`, and altered on `t`.
        try:
            desc = await asyncio.wait_for(
                admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, "r")]), 10
            )
            print(f"  describe_configs(r) -> {desc}")
        except Exception as e:
            print(f"  describe_configs failed: {e!r}")
        try:
            res2 = await asyncio.wait_for(
                admin.alter_configs(
                    [
                        ConfigResource(
                            ConfigResourceType.TOPIC,
                            "t",
                            {"retention.ms": "2000", "retention.bytes": "100000"},
                        )
                    ]
                ),
                10,
            )
            print(f"  alter_configs(t) -> {res2}")
        except Exception as e:
            print(f"  alter_configs failed: {e!r}")
        await fill(producer, "r", records, size)
        await report(child, boot, producer, "r", f"`r` (retention 2 s / 100 kB) after {records}")
        await asyncio.sleep(10)
        await report(child, boot, producer, "r", "`r` 10 s later")
        await report(child, boot, producer, "t", "`t` 10 s after alter_configs")

        # 3. Delete both topics.
        await admin.delete_topics(["t", "r"])
        await asyncio.sleep(2)
        print(f"{'after deleting both topics':45s} rss {rss_mb(child.proc.pid):7.1f} MB")
        await admin.create_topics([NewTopic("t", 1, 1)])
        await report(child, boot, producer, "t", "`t` re-created, empty")
        print(f"broker cpu total {process_cpu_seconds(child.proc.pid):.1f}s")
    finally:
        await producer.stop()
        await admin.close()
        await child.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.tansu_trim", description=__doc__)
    p.add_argument("--records", type=int, default=20000, help="records (one batch each) to fill with")
    p.add_argument("--size", type=int, default=2000, help="bytes per record")
    a = p.parse_args()
    run_cleanly(main(a.records, a.size))
