"""`ferry up` with a prefill pool and a decode pool, each given its own flags (--prefill-flags, --decode-flags):
the workers start with them, a request is prefilled on one pool and decoded on the other, and each worker's
metrics carry its role."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from kvstore.registry import Registry
from launch.services import Child
from schemas.names import RedisKeys
from schemas.settings import DEFAULT_MODEL_NAME as MODEL
from tests.harness import sse_events

pytestmark = pytest.mark.e2e


async def test_each_pool_starts_with_its_own_flags_and_serves_its_part(model_path: Path) -> None:
    child = await Child.spawn(
        "ferry-up",
        [sys.executable, "-m", "launch", "up", "--port", "0", "--workers", "0", "--prefill-workers", "1",
         "--decode-workers", "1", "--speedup", "20", "--model-path", str(model_path), "--max-num-seqs", "64",
         "--heartbeat-interval-s", "0.5", "--decode-flags=--max-num-seqs 3",
         "--prefill-flags", "--max-num-batched-tokens 1024 --max-num-seqs 16"],
        echo=False,
    )  # fmt: skip
    try:
        url = (await child.wait_for_line(lambda ln: ln.startswith("ferry-ready "), 120)).split()[1]
        redis_url = next(ln.split("Redis ")[1].split()[0] for ln in child.tail if ln.startswith("Kafka "))
        client = aioredis.from_url(redis_url)
        try:
            workers, _ = await Registry(client, RedisKeys()).snapshot()
        finally:
            await client.aclose()
        caps = {w.worker_id: (w.role, w.max_num_seqs) for w in workers}
        assert caps == {"prefill-0": ("prefill", 16), "decode-0": ("decode", 3)}

        # A prompt of several blocks, nothing of it cached: prefilled on the prefill worker, then decoded.
        body = {"model": MODEL, "prompt": "ferries cross the harbour at dawn " * 40, "max_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        async with (
            httpx.AsyncClient(base_url=url, timeout=60) as c,
            c.stream("POST", "/v1/completions", json=body) as r,
        ):
            if r.status_code != 200:
                # Seen once in a full run, not reproduced alone: a 503 from a produce that stalled 5 s on the fresh
                # stack's first request. The stack's own lines say where it stalled.
                pytest.fail(f"{r.status_code} {(await r.aread())!r}\n" + "\n".join(child.tail[-60:]))
            events = [json.loads(d) async for _, d in sse_events(r) if d != "[DONE]"]
        assert r.headers["x-ferry-disagg"] == "remote"
        assert events[-1]["usage"]["completion_tokens"] == 8

        # Each worker's samples say its role, so a dashboard can tell the pools apart.
        generated: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=10) as c:
            for group in (await c.get(f"{url}/discovery/prometheus")).json():
                if group["labels"]["role"] != "worker":
                    continue
                target = f"http://{group['targets'][0]}{group['labels']['__metrics_path__']}"
                for family in text_string_to_metric_families((await c.get(target)).text):
                    for sample in family.samples:
                        if sample.name == "ferry_worker_generated_tokens_total":
                            generated[sample.labels["worker_role"]] = sample.value
        assert generated == {"prefill": 1, "decode": 7}  # the first token is the prefill worker's
    finally:
        assert await child.stop(30) == 0, "\n".join(child.tail)
