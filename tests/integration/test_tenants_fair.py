"""Weighted-fair admission end to end: a real broker, Redis, a frontend with tenants and a saturated sim worker.

One sim worker runs one sequence at a time and the frontend counts it busy as soon as one request waits in its
engine, so a flood from one tenant backs up in the frontend. A quiet tenant of equal weight that arrives after
the flood is admitted ahead of the flood's backlog. With `--no-tenants-fair` the same test fails: the quiet
tenant's requests come after all 12 of the flood's (checked by hand: 1 flood request ahead of each quiet one
with fairness, 12 without).

Below the frontend: with a busy threshold the flood never reaches, its requests all go to the worker and wait
in the engine's queue; the quiet tenant's request carries a better engine priority and runs next. Without the
priorities (every request 0, as before they existed) it ran after every flood request queued there.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.harness import Harness, timed_chat, until

pytestmark = pytest.mark.integration

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
    first, _ = await timed_chat(url, key, f"Story {key} {i}", 24, started)
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


async def test_a_quiet_request_overtakes_a_floods_requests_waiting_in_the_engine(
    h: Harness, tmp_path: Path
) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    running = await h.add_worker(speedup=1.0, max_num_seqs=1)
    engine = running.worker.engine
    # Never busy for the frontend: every flood request is sent on, one runs and the others wait in the engine.
    _, url = await h.add_frontend(tenants=str(path), busy_waiting=FLOOD + 8, busy_wait_s=60.0)
    started = time.perf_counter()
    flood = [asyncio.create_task(first_token(url, "key-flood", i, started)) for i in range(FLOOD)]

    async def backed_up() -> bool:
        return engine.stats().waiting >= FLOOD // 2

    await until(backed_up, 30)
    sent = time.perf_counter() - started
    quiet = await first_token(url, "key-quiet", 0, started)
    async with asyncio.timeout(120):
        flood_t = await asyncio.gather(*flood)
    # Flood requests that got their first token between the quiet one's arrival and its own: at most the one
    # running (and one more if it ended as the quiet request was on its way); arrival order: every one waiting.
    overtaken_by = sum(sent < f < quiet for f in flood_t)
    assert overtaken_by <= 2, (overtaken_by, sent, quiet, sorted(flood_t))
    assert sum(f > quiet for f in flood_t) >= FLOOD // 2 - 2
