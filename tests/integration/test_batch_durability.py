"""Batches survive a killed worker and a restarted frontend; cancel and expiry end with one line per item."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from launch.services import Child
from server.batch.service import BatchService
from tests.harness import Harness, harness, worker_process
from tests.integration.test_batch_api import chat_line, final_batch, jsonl, model_name, until


def slow_lines(model: str, n: int, tokens: int = 48) -> bytes:
    """Requests that each take a while on a sim worker at speedup 1 (a fixed number of output tokens)."""
    return jsonl(
        [
            chat_line(f"r{i}", model, f"Item {i} of the job.", max_tokens=tokens, ignore_eos=True)
            for i in range(n)
        ]
    )


async def slow_batch_under_way(client: AsyncOpenAI, model: str, n: int, started: int = 4) -> Any:
    """A batch of `n` slow_lines items, once `started` results are in (more items are running on workers)."""
    f = await client.files.create(file=("in.jsonl", slow_lines(model, n)), purpose="batch")
    batch = await client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    async def some_done() -> bool:
        b = await client.batches.retrieve(batch.id)
        return b.request_counts is not None and b.request_counts.completed >= started

    await until(some_done, what="the first results")
    return batch


async def every_line(client: AsyncOpenAI, batch: Any) -> Counter[str]:
    """custom_id -> how many lines it has across the output and error files."""
    ids: Counter[str] = Counter()
    for fid in (batch.output_file_id, batch.error_file_id):
        if fid:
            for raw in (await client.files.content(fid)).text.splitlines():
                ids[json.loads(raw)["custom_id"]] += 1
    return ids


def batch_service(h: Harness, i: int = -1) -> BatchService:
    """The batch service of the i-th frontend the harness started."""
    server, _ = h._servers[i]
    app: Any = server.config.app
    svc: BatchService = app.state.batch
    return svc


async def stop_frontend(h: Harness, i: int) -> None:
    server, task = h._servers[i]
    server.should_exit = True
    await asyncio.wait_for(task, 15)


async def test_batch_survives_a_killed_worker_and_a_frontend_restart(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    flags = [
        "--served-model-name",
        model,
        "--speedup",
        "2",
        "--pool-max-inflight",
        "3",
        "--pool-session-timeout-s",
        "2",
    ]
    workers: list[Child] = []
    try:
        for i in range(2):
            workers.append(
                await worker_process(f"bw{i}-{model}", kafka, redis_url, prefix, model_path, *flags)
            )
        async with harness(kafka, redis_url, prefix, model_path) as h:
            _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            n = 40
            batch = await slow_batch_under_way(client, model, n)
            # A worker dies with items running: they were never committed, so the other worker runs them.
            workers[0].kill()
            await workers[0].proc.wait()
            # The frontend goes away and another one (new id, same Redis and topics) carries on.
            await stop_frontend(h, 0)
            _, url2 = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
            client2 = AsyncOpenAI(base_url=f"{url2}/v1", api_key="unused", max_retries=0)
            done = await final_batch(client2, batch.id, limit_s=120)
            assert done.status == "completed", done
            assert done.request_counts.total == n and done.request_counts.completed == n
            assert done.request_counts.failed == 0
            ids = await every_line(client2, done)
            assert ids == Counter({f"r{i}": 1 for i in range(n)})
    finally:
        for w in workers:
            with contextlib.suppress(Exception):
                await w.stop()


async def test_cancel_stops_new_items_and_accounts_for_every_item(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        await h.add_worker(pool=True, served_model_name=model, speedup=2.0, pool_max_inflight=2)
        _, url = await h.add_frontend(
            batch_api=True, served_model_name=model, batch_dir=str(tmp_path), batch_cancel_grace_s=1.0
        )
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        n = 60
        batch = await slow_batch_under_way(client, model, n, started=2)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at
        done = await final_batch(client, batch.id)
        assert done.status == "cancelled" and done.cancelled_at
        counts = done.request_counts
        assert counts.total == n and counts.completed + counts.failed == n
        assert 2 <= counts.completed < n
        ids = await every_line(client, done)
        assert ids == Counter({f"r{i}": 1 for i in range(n)})
        errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
        assert {e["error"]["code"] for e in errors} <= {"batch_cancelled", "request_aborted"}
        # Cancelling again returns the batch as it is.
        assert (await client.batches.cancel(batch.id)).status == "cancelled"


async def test_an_expired_window_ends_expired_with_partial_results(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        w = await h.add_worker(pool=True, served_model_name=model, speedup=2.0, pool_max_inflight=2)
        _, url = await h.add_frontend(
            batch_api=True, served_model_name=model, batch_dir=str(tmp_path), batch_windows="24h,3s"
        )
        # The window is short: start it once the pool and results consumer groups have settled.
        assert w.worker.pool is not None
        await asyncio.wait_for(w.worker.pool.joined.wait(), 30)
        collector = batch_service(h).collector
        assert collector is not None
        await asyncio.wait_for(collector.joined.wait(), 30)
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        n = 80
        f = await client.files.create(file=("in.jsonl", slow_lines(model, n)), purpose="batch")
        batch = await client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="3s",  # type: ignore[arg-type]
        )
        assert batch.expires_at == batch.created_at + 3
        done = await final_batch(client, batch.id)
        assert done.status == "expired" and done.expired_at
        counts = done.request_counts
        assert counts.total == n and 0 < counts.completed < n and counts.completed + counts.failed == n
        ids = await every_line(client, done)
        assert ids == Counter({f"r{i}": 1 for i in range(n)})
        errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
        assert "batch_expired" in {e["error"]["code"] for e in errors}
