"""A tenant's batch is charged to the tenant: usage records on the usage topic and its tokens per minute.

Real broker, Redis and a sim worker; the batch goes through the official openai client with the tenant's key.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from launch.usage import read_usage, summarize
from tests.harness import harness, until

pytestmark = pytest.mark.integration

TENANTS = """
[tenants.batcher]
api_keys = ["key-batcher"]
tokens_per_minute = 100000

[tenants.other]
api_keys = ["key-other"]
"""


async def room_in_the_minute(redis_url: str, seconds: int) -> None:
    """Return with at least `seconds` left before Redis's clock turns a minute (the quota windows)."""
    redis = aioredis.from_url(redis_url)
    secs, _ = await redis.time()
    await redis.aclose()
    if secs % 60 > 60 - seconds:
        await asyncio.sleep(61 - secs % 60)


async def test_a_tenants_batch_is_its_usage_and_counts_against_its_tokens_per_minute(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = f"m-{uuid.uuid4().hex[:8]}"  # pool and results topics of this test's own
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    async with harness(kafka, redis_url, prefix, model_path) as h:
        await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path), tenants=str(tenants))
        await room_in_the_minute(redis_url, 40)
        since = time.time() - 1
        auth = {"Authorization": "Bearer key-batcher"}
        long = " ".join(f"word{i}" for i in range(120))  # repeated: the items after the first hit the cache
        chat = {"model": model, "messages": [{"role": "user", "content": f"{long} Hi"}], "max_tokens": 8}
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            first = await c.post("/v1/chat/completions", json=chat, headers=auth)
            assert first.status_code == 200, first.text
            left_after_first = int(first.headers["x-ratelimit-remaining-tokens"])

            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="key-batcher", max_retries=0)
            lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat}
                     for i in range(3)]  # fmt: skip
            data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
            f = await client.files.create(file=("in.jsonl", data), purpose="batch")
            batch = await client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )

            async def ended() -> bool:
                b = await client.batches.retrieve(batch.id)
                return b.status in ("completed", "failed", "expired", "cancelled")

            # The worker's pool group and the frontend's results group each join first: on the embedded
            # broker a first join can take ~18 s.
            await until(ended, 60)
            done = await client.batches.retrieve(batch.id)
            assert done.status == "completed" and done.output_file_id, done
            out = [
                json.loads(x) for x in (await client.files.content(done.output_file_id)).content.splitlines()
            ]
            items = [o["response"]["body"]["usage"] for o in out]
            assert len(items) == 3
            batch_tokens = sum(u["prompt_tokens"] + u["completion_tokens"] for u in items)

            last = await c.post("/v1/chat/completions", json=chat, headers=auth)
            assert last.status_code == 200, last.text
        # The tokens per minute: the first request's completion, the batch's tokens, the last one's prompt.
        used = (
            first.json()["usage"]["completion_tokens"] + batch_tokens + last.json()["usage"]["prompt_tokens"]
        )
        assert left_after_first - int(last.headers["x-ratelimit-remaining-tokens"]) == used
        # The usage topic: two interactive requests and three batch items, all the tenant's.
        responses = [first.json()["usage"], *items, last.json()["usage"]]
        expected = {
            "requests": 5, "errors": 0,
            "prompt_tokens": sum(u["prompt_tokens"] for u in responses),
            "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in responses),
            "completion_tokens": sum(u["completion_tokens"] for u in responses),
        }  # fmt: skip
        assert expected["cached_tokens"] > 0

        seen: list[object] = []

        async def published() -> bool:
            records = await read_usage(kafka, since)
            seen[:] = [summarize(records, "tenant").get("batcher"), records]
            return seen[0] == expected

        try:
            await until(published, 20, period_s=0.5)
        except TimeoutError:
            raise AssertionError(f"usage topic: {seen[0]} != {expected}; records: {seen[1]}") from None
