"""Cache-aware routing with real vLLM workers: their KV events reach the index and steer the router."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from server.services import Child
from tests.harness import Harness, harness

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"


@pytest_asyncio.fixture
async def two_vllm_workers(
    kafka: str, redis_url: str, prefix: str, model_path: Path
) -> AsyncIterator[tuple[Harness, list[Child]]]:
    async with harness(kafka, redis_url, prefix, model_path) as h:
        children = [
            await Child.spawn(
                f"vllm-{i}",
                [sys.executable, "-m", "workers", "--engine", "vllm", "--worker-id", f"vllm-{i}",
                 "--block-size", "32", "--kafka", kafka, "--redis", redis_url, "--redis-prefix", prefix,
                 "--model-path", str(model_path), "--kv-cache-gib", "0.25", "--log-level", "warning"],
                echo=False,
            )
            for i in range(2)
        ]
        try:
            await asyncio.gather(
                *(c.wait_for_line(lambda line: line.startswith("ferry-worker-ready"), 180) for c in children)
            )
            yield h, children
        finally:
            await asyncio.gather(*(c.stop(30) for c in children))


async def test_shared_prefix_follows_the_cache(two_vllm_workers: tuple[Harness, list[Child]]) -> None:
    h, _children = two_vllm_workers
    _fe, url = await h.add_frontend()
    system = "You are a meticulous geography tutor. " * 45  # a long shared prefix: many 32-token blocks
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:

        async def ask(question: str) -> httpx.Response:
            body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
            r = await c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r

        first = await ask("What is the capital of France?")
        holder = first.headers["x-ferry-worker"]
        assert first.json()["usage"]["prompt_tokens"] > 320
        second = await ask("What is the capital of Spain?")
        assert second.headers["x-ferry-worker"] == holder
        assert int(second.headers["x-ferry-predicted-cached-blocks"]) >= 8
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
