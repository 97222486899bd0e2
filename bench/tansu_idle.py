"""Tansu's CPU while ten idle consumers poll one topic at a 5 ms fetch wait, as the topic grows.

Checks whether the embedded broker's cost per idle fetch grows with what a topic holds
(docs/benchmarks.md, "Embedded broker probes"). Run: `.venv/bin/python -m bench.tansu_idle`.
"""

from __future__ import annotations

import asyncio
import os
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from bench.stack import run_cleanly
from bus.topics import ensure_topics
from launch.services import Child, start_broker


def cpu(pid: int) -> float:
    """CPU seconds `pid` has used."""
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().split(")")[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

async def idle_cpu(child: Child, consumers: list[AIOKafkaConsumer], secs: float = 4.0) -> float:
    """Broker CPU, in cores, while `consumers` poll for `secs`."""
    tasks = [asyncio.create_task(poll(c, secs)) for c in consumers]
    t0, w0 = cpu(child.proc.pid), time.time()
    await asyncio.gather(*tasks)
    return (cpu(child.proc.pid) - t0) / (time.time() - w0)

async def poll(c: AIOKafkaConsumer, secs: float) -> None:
    """Fetch until `secs` are over."""
    end = time.time() + secs
    while time.time() < end:
        await c.getmany(timeout_ms=100)

async def main() -> None:
    """Grow one topic in steps and measure the broker at each."""
    child, boot = await start_broker()
    await ensure_topics(boot, {"big": 1})
    p = AIOKafkaProducer(bootstrap_servers=boot, linger_ms=5)
    await p.start()
    cons: list[AIOKafkaConsumer] = []
    for _ in range(10):
        c = AIOKafkaConsumer(bootstrap_servers=boot, enable_auto_commit=False, fetch_max_wait_ms=5)
        await c.start()
        tp = TopicPartition("big", 0)
        c.assign([tp])
        await c.seek_to_end(tp)
        cons.append(c)
    total = 0
    for target in (0, 5000, 20000, 40000):
        while total < target:
            fs = [await p.send("big", b"x" * 200, partition=0) for _ in range(500)]
            await asyncio.gather(*fs)
            total += 500
        for c in cons:
            await c.seek_to_end(TopicPartition("big", 0))
        await asyncio.sleep(0.5)
        share = 100 * await idle_cpu(child, cons)
        print(f"records {total:6d}: Tansu CPU with 10 idle consumers polling at 5 ms = {share:.0f}% of a core")
    for c in cons:
        await c.stop()
    await p.stop()
    await child.stop()
if __name__ == "__main__":
    run_cleanly(main())
