"""The Files and Batches API through the official openai client, against the real broker, Redis and sim workers."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from bus.topics import existing_topics
from schemas.names import admin_topic, batch_results_topic, batch_submit_topic
from tests.harness import harness


def model_name() -> str:
    """A model name of the test's own, so its pool and results topics are its own too."""
    return f"m-{uuid.uuid4().hex[:8]}"


def chat_line(custom_id: str, model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 8,
            **extra,
        },
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


async def until(check: Callable[[], Awaitable[Any]], limit_s: float = 60.0, what: str = "condition") -> Any:
    """Poll `check` until it returns something truthy, failing after `limit_s` seconds."""
    deadline = time.monotonic() + limit_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # poll period


async def final_batch(client: AsyncOpenAI, batch_id: str, limit_s: float = 60.0) -> Any:
    async def done() -> Any:
        b = await client.batches.retrieve(batch_id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    return await until(done, limit_s, f"batch {batch_id} to end")


async def test_batch_round_trip_with_openai_client(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

        lines = [chat_line(f"req-{i}", model, f"Question number {i}?") for i in range(12)]
        lines.append(chat_line("too-long", model, "hi", max_tokens=10**6))
        lines.append(chat_line("two", model, "Give me two answers.", n=2))
        f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert f.purpose == "batch" and f.bytes > 0
        assert (await client.files.retrieve(f.id)).filename == "in.jsonl"
        assert (await client.files.content(f.id)).content == jsonl(lines)

        batch = await client.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "test"},
        )
        assert batch.status == "validating" and batch.metadata == {"job": "test"}
        done = await final_batch(client, batch.id)
        assert done.status == "completed", done
        assert done.request_counts.total == 14
        assert done.request_counts.completed == 13
        assert done.request_counts.failed == 1
        assert done.in_progress_at and done.finalizing_at and done.completed_at
        assert done.usage.input_tokens > 0 and done.usage.output_tokens > 0

        out = [json.loads(x) for x in (await client.files.content(done.output_file_id)).text.splitlines()]
        assert sorted(o["custom_id"] for o in out) == sorted([f"req-{i}" for i in range(12)] + ["two"])
        for o in out:
            assert o["error"] is None and o["id"].startswith("batch_req_")
            assert o["response"]["status_code"] == 200
            body = o["response"]["body"]
            assert body["object"] == "chat.completion" and body["model"] == model
            assert body["choices"][0]["message"]["content"]
            assert len(body["choices"]) == (2 if o["custom_id"] == "two" else 1)
        errors = [json.loads(x) for x in (await client.files.content(done.error_file_id)).text.splitlines()]
        assert [e["custom_id"] for e in errors] == ["too-long"]
        assert errors[0]["response"]["status_code"] == 400
        assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"

        # The answer in a batch is the answer the interactive route gives (the sim engine is deterministic).
        interactive = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Question number 3?"}], max_tokens=8
        )
        line3 = next(o for o in out if o["custom_id"] == "req-3")
        assert (
            line3["response"]["body"]["choices"][0]["message"]["content"]
            == interactive.choices[0].message.content
        )

        # Listing pages through every batch, newest first.
        second = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        page = await client.batches.list(limit=1)
        assert [b.id for b in page.data] == [second.id] and page.has_more
        page2 = await client.batches.list(limit=1, after=second.id)
        assert [b.id for b in page2.data] == [batch.id] and not page2.has_more
        await final_batch(client, second.id)

        deleted = await client.files.delete(f.id)
        assert deleted.deleted
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(f.id)


async def test_invalid_files_and_batches_are_refused_clearly(
    kafka: str, redis_url: str, prefix: str, model_path: Path, tmp_path: Path
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        _, url = await h.add_frontend(batch_api=True, served_model_name=model, batch_dir=str(tmp_path))
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        good = chat_line("a", model, "hi")
        cases = {
            b'{"custom_id": "a"\n': "Line 1 is not valid JSON",
            jsonl([good, good]): "Line 2: `custom_id` 'a' is already used on line 1",
            jsonl(
                [good, {**good, "custom_id": "b", "url": "/v1/embeddings"}]
            ): "Line 2: `url` must be one of",
            jsonl([good, {**good, "custom_id": "b", "method": "GET"}]): "Line 2: `method` must be POST",
            jsonl(
                [{k: v for k, v in good.items() if k != "custom_id"}]
            ): "Line 1: Object missing required field",
            b"\n\n": "The file holds no request lines",
        }
        for data, message in cases.items():
            with pytest.raises(openai.BadRequestError) as info:
                await client.files.create(file=("x.jsonl", data), purpose="batch")
            assert message in info.value.message, (message, info.value.message)
        with pytest.raises(openai.BadRequestError):
            await client.files.create(file=("x.jsonl", jsonl([good])), purpose="fine-tune")

        f = await client.files.create(file=("x.jsonl", jsonl([good])), purpose="batch")
        with pytest.raises(openai.BadRequestError) as info:
            await client.batches.create(
                input_file_id=f.id,
                endpoint="/v1/chat/completions",
                completion_window="1h",  # type: ignore[arg-type]
            )
        assert info.value.body["param"] == "completion_window"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(
                input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
            )
        with pytest.raises(openai.BadRequestError):
            await client.batches.create(
                input_file_id=f.id,
                endpoint="/v1/embeddings",  # type: ignore[arg-type]
                completion_window="24h",
            )
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_nope")

        # A line whose url differs from the batch's endpoint fails the batch, naming the line.
        batch = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
        h_worker = await h.add_worker(pool=True, served_model_name=model, speedup=200.0)
        assert h_worker.worker.ready.is_set()
        failed = await final_batch(client, batch.id)
        assert failed.status == "failed" and failed.failed_at
        assert failed.errors.data[0].code == "mismatched_url" and failed.errors.data[0].line == 1


async def test_a_frontend_without_the_batch_api_says_so_and_starts_no_batch_reader(
    kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    model = model_name()
    async with harness(kafka, redis_url, prefix, model_path) as h:
        fe, url = await h.add_frontend(batch_api=False, served_model_name=model)
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for call in (client.batches.list(), client.files.list(), client.batches.retrieve("batch_x")):
            with pytest.raises(openai.NotFoundError) as err:
                await call
            assert "--no-batch-api" in err.value.message
        # The batch readers create their topics before they join their groups: a frontend with the API
        # makes them at start-up, this one made none (its admin replies topic, made at start-up, is listed).
        topics = [batch_results_topic(model), batch_submit_topic(model), admin_topic(fe.settings.frontend_id)]
        assert await existing_topics(kafka, topics) == [admin_topic(fe.settings.frontend_id)]
