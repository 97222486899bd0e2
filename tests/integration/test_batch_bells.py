"""Batch readers sleep while the pool is idle and are rung by whoever wrote their records (kvstore/bells.py): a
worker's pool consumer by the frontend that wrote items, a frontend's results reader by the worker whose result
is in. On the real broker and Redis, with both readers' fallback polls far longer than the test's waits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from bus.reader import Reader
from tests.harness import harness, until
from tests.integration.test_batch_api import chat_line, final_batch, jsonl, model_name

pytestmark = pytest.mark.integration

# Far longer than the batch's whole run below: a batch that completes was read because of the rings.
FALLBACK_MS = 120_000


async def test_idle_batch_readers_sleep_and_a_batch_wakes_them(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("workers.pool_consumer.BATCH_SLEEP_MS", FALLBACK_MS)
    monkeypatch.setattr("server.batch.results.BATCH_SLEEP_MS", FALLBACK_MS)
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        running = await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
        pool, service = running.worker.pool, h.apps[-1].state.batch
        assert pool is not None and pool.bell_subscription is not None and service.collector is not None
        # Idle: both readers sleep with their partitions paused, their fetchers sending nothing.
        await until(lambda: _asleep(pool.reader), 30)
        await until(lambda: _asleep(service.collector.reader), 30)
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        lines = [chat_line(f"req-{i}", model, f"Question number {i}?") for i in range(8)]
        f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = await final_batch(client, batch.id, limit_s=60)
        assert done.status == "completed" and done.request_counts.completed == 8, done
        assert pool.bell_subscription.rings >= 1


async def _asleep(reader: Reader[Any]) -> bool:
    assigned = reader.consumer.assignment()
    return reader.sleeps > 0 and bool(assigned) and assigned <= reader.consumer.paused()
