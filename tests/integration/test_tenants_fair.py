"""Weighted-fair admission end to end: a real broker, Redis, a frontend with tenants and a saturated sim worker.

One sim worker runs one sequence at a time and the frontend counts it busy as soon as one request waits in its
engine, so a flood from one tenant backs up in the frontend. A quiet tenant of equal weight that arrives after
the flood is admitted ahead of the flood's backlog. With `--no-tenants-fair` the same test fails: the quiet
tenant's requests come after all 12 of the flood's (checked by hand: 1 flood request ahead of each quiet one
with fairness, 12 without).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.harness import Harness, sse_events, until

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
TENANTS = """
[tenants.flood]
api_keys = ["key-flood"]

[tenants.quiet]
api_keys = ["key-quiet"]
"""
FLOOD = 12
QUIET = 2


async def first_token(url: str, key: str, i: int, started: float) -> float:
    """Stream one chat; seconds from `started` to its first content token (the stream is read to its end)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Story {key} {i}"}], "max_tokens": 24,
            "ignore_eos": True, "stream": True}  # fmt: skip
    first = None
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async with c.stream(
            "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            assert r.status_code == 200, await r.aread()
            async for _, data in sse_events(r):
                if data == "[DONE]":
                    break
                delta = json.loads(data)["choices"][0]["delta"]
                if first is None and delta.get("content"):
                    first = time.perf_counter() - started
    assert first is not None
    return first


async def test_a_quiet_tenant_goes_ahead_of_a_floods_backlog(h: Harness, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    await h.add_worker(speedup=4.0, max_num_seqs=1)
    fe, url = await h.add_frontend(tenants=str(path), busy_waiting=1, busy_wait_s=60.0)
    started = time.perf_counter()
    flood = [asyncio.create_task(first_token(url, "key-flood", i, started)) for i in range(FLOOD)]

    async def flood_admitted() -> bool:
        return bool(fe.metrics.tenant_inflight.labels("flood")._value.get() == FLOOD)

    await until(flood_admitted, 30)  # every flood request is past its quota, running or backed up
    quiet = [asyncio.create_task(first_token(url, "key-quiet", i, started)) for i in range(QUIET)]
    async with asyncio.timeout(120):
        flood_t, quiet_t = await asyncio.gather(asyncio.gather(*flood), asyncio.gather(*quiet))
    # How many flood requests got their first token before each quiet one did. Arrival order: about all of
    # them (the flood's backlog is ahead); fair order: the few already on the worker, then turns alternate.
    ahead = [sum(f < q for f in flood_t) for q in quiet_t]
    assert max(ahead) <= FLOOD // 2, (ahead, sorted(flood_t), quiet_t)
