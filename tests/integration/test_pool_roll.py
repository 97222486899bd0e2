"""--pool-roll-s on the embedded broker: batch items and results on epochs of the clock, read ones deleted."""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from openai import AsyncOpenAI

from bench.batch.kafka_native_example import chat_item, submit_and_collect
from bus.epochs import EpochTopics
from bus.topics import list_topics
from launch.services import Child
from schemas.names import batch_results_pattern, batch_results_topic, pool_pattern, pool_topic, request_epoch
from tests.harness import Harness, harness, worker_process
from tests.integration.test_batch_api import chat_line, final_batch, jsonl, until
from tests.integration.test_batch_durability import (
    every_line,
    slow_batch_under_way,
    stop_frontend,
)

ROLL_S = 6.0


@pytest.fixture(autouse=True)
def short_grace() -> Iterator[None]:
    """Epochs deletable 1 s after they end (30 s in production: longer than a send takes)."""
    saved = EpochTopics.GRACE_S
    EpochTopics.GRACE_S = 1.0
    yield
    EpochTopics.GRACE_S = saved


def epoch_now() -> int:
    return int(time.time() // ROLL_S)


async def epochs(kafka: str, pattern: str) -> dict[int, str]:
    """The rolled topics of a family the broker lists now, by epoch."""
    rx = re.compile(pattern)
    out = {}
    for t in await list_topics(kafka):
        e = request_epoch(t)
        if rx.match(t) and e is not None:
            out[e] = t
    return out


async def records_in(kafka: str, topics: list[str]) -> dict[str, int]:
    """Records each topic holds (sum of its partitions' end offsets); topics asked for after listing all."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka, enable_auto_commit=False)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [TopicPartition(t, p) for t in topics for p in consumer.partitions_for_topic(t) or ()]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    out = dict.fromkeys(topics, 0)
    for tp, end in ends.items():
        out[tp.topic] += end
    return out


async def submit(client: AsyncOpenAI, model: str, tag: str, count: int, **extra: Any) -> str:
    lines = [chat_line(f"{tag}-{i}", model, f"Question {tag} number {i}?", **extra) for i in range(count)]
    f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    b = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return b.id


def model_name() -> str:
    return f"m-{uuid.uuid4().hex[:8]}"


async def test_a_batch_across_pool_rolls_completes_and_read_epochs_are_deleted(
    h: Harness, kafka: str, tmp_path: Path
) -> None:
    model = model_name()
    roll = {"pool_roll_s": ROLL_S}
    await h.add_worker(pool=True, served_model_name=model, speedup=20.0, pool_max_inflight=2, **roll)
    await h.add_worker(pool=True, served_model_name=model, speedup=20.0, pool_max_inflight=2, **roll)
    _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path), **roll)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    # Three batches, each submitted in a later epoch than the one before: their items are in three pool
    # epochs, and their results (a few seconds of work at 2 items per worker) span several results epochs.
    ids, used = [], []
    for tag in ("a", "b", "c"):
        e = epoch_now()
        used.append(e)
        ids.append(await submit(client, model, tag, 8, max_tokens=24, n=2 if tag == "b" else 1))
        await until(lambda e=e: _after(e), ROLL_S * 2, "the next epoch")  # type: ignore[misc]
    seen_results: set[int] = set()
    for batch_id, tag in zip(ids, ("a", "b", "c"), strict=True):
        seen_results |= set(await epochs(kafka, batch_results_pattern(model)))
        # Every roll rebalances both groups (~3 s each on the embedded broker, at 6 s epochs), and a first
        # join now and then takes ~18 s.
        done = await final_batch(client, batch_id, 90)
        assert done.status == "completed", done
        assert done.request_counts.completed == 8 and done.request_counts.failed == 0
        out = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted(f"{tag}-{i}" for i in range(8))
        for o in out:
            assert o["response"]["status_code"] == 200
            assert len(o["response"]["body"]["choices"]) == (2 if tag == "b" else 1)

    # Every epoch the items were in is deleted once past (and read); so is every past results epoch.
    last = epoch_now()

    async def pool_gone() -> bool:
        return not any(e <= max(used) for e in await epochs(kafka, pool_pattern(model)))

    async def results_gone() -> bool:
        return not any(e <= last for e in await epochs(kafka, batch_results_pattern(model)))

    await until(pool_gone, 30, "the read pool epochs to be deleted")
    await until(results_gone, 30, "the read results epochs to be deleted")
    # The current and the next epochs are there for writers; nothing older.
    now = epoch_now()
    assert all(e >= now - 1 for e in await epochs(kafka, pool_pattern(model)))
    assert len(seen_results) >= 2, seen_results
    # And they stay deleted: pattern subscriptions and idle producers never ask for them by name (broker
    # quirk "metadata re-creates topics"), through another roll and its rebalances.
    e = epoch_now()
    await until(lambda: _after(e + 1), ROLL_S * 3, "two more epochs")
    assert await pool_gone() and await results_gone()


async def _after(e: int) -> bool:
    return epoch_now() > e


async def test_an_unread_pool_epoch_stays_until_a_late_worker_reads_it(
    h: Harness, kafka: str, tmp_path: Path
) -> None:
    model = model_name()
    roll = {"pool_roll_s": ROLL_S}
    # A worker without pool work: the coordinator submits (it needs a live worker's context length), but
    # nobody takes the items.
    await h.add_worker(pool=False, served_model_name=model, **roll)
    _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path), **roll)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    batch_id = await submit(client, model, "late", 6)

    async def submitted() -> bool:
        b = await client.batches.retrieve(batch_id)
        return b.status == "in_progress"

    await until(submitted, 30, "the batch to be submitted")
    e = epoch_now()
    await until(lambda: _after(e), ROLL_S * 2, "an epoch to pass")
    listed = await epochs(kafka, pool_pattern(model))
    held = {t: n for t, n in (await records_in(kafka, list(listed.values()))).items() if n}
    assert sum(held.values()) == 6, held
    (item_epoch,) = [request_epoch(t) for t in held]
    assert item_epoch is not None

    # Later epochs (empty) come and go past it, while it stays: its items were never read.
    async def newer_deleted() -> bool:
        now = epoch_now()
        listed = await epochs(kafka, pool_pattern(model))
        return now - 2 > item_epoch and not any(item_epoch < e < now - 1 for e in listed)

    await until(newer_deleted, 30, "empty past epochs to be deleted")
    assert item_epoch in await epochs(kafka, pool_pattern(model))

    # A worker joining now reads it (the group subscribes by pattern); then it goes.
    await h.add_worker(pool=True, served_model_name=model, speedup=200.0, **roll)
    done = await final_batch(client, batch_id, 60)
    assert done.status == "completed" and done.request_counts.completed == 6, done

    async def deleted() -> bool:
        return item_epoch not in await epochs(kafka, pool_pattern(model))

    await until(deleted, 30, "the read epoch to be deleted")


async def test_kafka_native_items_are_served_through_rolled_pool_topics(
    h: Harness, kafka: str, tmp_path: Path
) -> None:
    model = model_name()
    roll = {"pool_roll_s": ROLL_S}
    await h.add_worker(pool=True, served_model_name=model, speedup=200.0, **roll)
    await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path), **roll)
    reply = f"svc.results.{uuid.uuid4().hex[:6]}"
    items = [chat_item(f"k{i}", model, f"Question {i}?", reply) for i in range(6)]
    results = await submit_and_collect(kafka, model, items, reply, timeout_s=60)
    assert set(results) == {item["custom_id"] for item in items}
    assert all(line["response"]["status_code"] == 200 for line in results.values())
    # Only epochs went to the broker: the unrolled pool and results topics were never made.
    names = await list_topics(kafka)
    assert pool_topic(model) not in names and batch_results_topic(model) not in names
    assert await epochs(kafka, pool_pattern(model))


async def test_a_rolled_batch_survives_a_killed_worker_and_a_frontend_restart(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    flags = ["--served-model-name", model, "--speedup", "4", "--pool-max-inflight", "3",
             "--pool-session-timeout-s", "2", "--pool-roll-s", str(ROLL_S)]  # fmt: skip
    workers: list[Child] = []
    try:
        for i in range(2):
            workers.append(
                await worker_process(f"rw{i}-{model}", kafka, redis_url, prefix, model_path, *flags)
            )
        async with harness(kafka, redis_url, prefix, model_path) as h:
            fe = {
                "batch_api": True,
                "served_model_name": model,
                "batch_dir": str(tmp_path),
                "pool_roll_s": ROLL_S,
            }
            _, url = await h.add_frontend(**fe)
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            n = 30
            batch = await slow_batch_under_way(client, model, n)
            # A worker dies with items running (never committed: the other worker runs them), and the frontend
            # holding the deletion lease goes; another one carries on, while epochs keep rolling.
            workers[0].kill()
            await workers[0].proc.wait()
            await stop_frontend(h, 0)
            _, url2 = await h.add_frontend(**fe)
            client2 = AsyncOpenAI(base_url=f"{url2}/v1", api_key="unused", max_retries=0)
            done = await final_batch(client2, batch.id, limit_s=150)
            assert done.status == "completed", done
            assert done.request_counts.completed == n and done.request_counts.failed == 0
            assert await every_line(client2, done) == Counter({f"r{i}": 1 for i in range(n)})
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                await w.stop()
