"""The fair queue's reserve end to end: a real broker, Redis, a frontend with tenants and a sim worker of two
running slots.

While the quiet tenant is active, the flood holds at most one of the worker's two slots (`--tenants-reserve
1`) and the rest of it waits in the frontend, so the quiet tenant's next request starts at once, before any
flood sequence ends. With `--tenants-reserve 0` (as before the reserve existed) the test fails: the flood
fills both slots, and the quiet request, first in the engine's queue, waits for a flood sequence to end
(checked by hand: sent at 0.8 s, its first token at 3.8 s, just after the first flood sequence ended at
3.7 s). A tenant active alone fills both slots. Across two frontends (the quiet tenant on one, the flood on the
other) the flood's frontend learns from the shared counters that the quiet tenant is active, and the other
frontends' sequences count against the slots (with `--tenants-reserve 0` it fails the same way: quiet
request sent at 0.9 s, first token at 3.6 s, after the first flood sequence ended).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from server.frontend import Frontend
from tests.harness import Harness, timed_chat, until
from workers.engine import Engine

pytestmark = pytest.mark.integration

TENANTS = """
[tenants.flood]
api_keys = ["key-flood"]

[tenants.quiet]
api_keys = ["key-quiet"]
"""
FLOOD = 3
LONG = 200  # tokens of a flood sequence: ~2.3 s at the worker's speed


async def timed(url: str, key: str, max_tokens: int, started: float) -> tuple[float, float]:
    """Stream one chat; seconds from `started` to its first content token and to its end."""
    return await timed_chat(url, key, f"Story for {key}", max_tokens, started)


async def stack(h: Harness, tmp_path: Path) -> tuple[str, Frontend, Engine]:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    worker = await h.add_worker(speedup=0.5, max_num_seqs=2)
    # Never busy for the frontend: without the reserve every flood request goes on to the worker at once.
    fe, url = await h.add_frontend(
        tenants=str(path), busy_waiting=FLOOD + 8, busy_wait_s=60.0, tenants_reserve=1
    )
    return url, fe, worker.worker.engine


async def test_a_quiet_request_finds_a_running_slot_free_beside_a_flood(h: Harness, tmp_path: Path) -> None:
    url, fe, engine = await stack(h, tmp_path)
    started = time.perf_counter()
    await timed(url, "key-quiet", 4, started)  # the quiet tenant is active from now on
    flood = [asyncio.create_task(timed(url, "key-flood", LONG, started)) for _ in range(FLOOD)]

    async def flood_placed() -> bool:
        # Every flood request is running, waiting in the engine or held back in the frontend.
        st = engine.stats()
        queued = fe.metrics.tenant_queued.labels("flood")._value.get()
        return bool(st.running >= 1 and st.running + st.waiting + queued == FLOOD)

    await until(flood_placed, 30)
    sent = time.perf_counter() - started
    quiet_first, _ = await timed(url, "key-quiet", 4, started)
    async with asyncio.timeout(60):
        flood_t = await asyncio.gather(*flood)
    # A running slot was free for it: it started before any flood sequence ended (without the reserve it
    # waits for the first one to end).
    first_end = min(end for _, end in flood_t)
    assert quiet_first < first_end, (sent, quiet_first, sorted(flood_t))


async def test_a_tenant_active_alone_fills_every_slot(h: Harness, tmp_path: Path) -> None:
    url, _, engine = await stack(h, tmp_path)
    flood = [asyncio.create_task(timed(url, "key-flood", LONG, time.perf_counter())) for _ in range(FLOOD)]
    peak = 0

    async def both_slots() -> bool:
        nonlocal peak
        peak = max(peak, engine.stats().running)
        return peak == 2

    await until(both_slots, 30, period_s=0.01)
    async with asyncio.timeout(60):
        await asyncio.gather(*flood)


async def test_the_reserve_holds_across_frontends(h: Harness, tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TENANTS)
    engine = (await h.add_worker(speedup=0.5, max_num_seqs=2)).worker.engine
    settings = {"tenants": str(path), "busy_waiting": FLOOD + 8, "busy_wait_s": 60.0, "tenants_reserve": 1}
    _, quiet_url = await h.add_frontend(**settings)
    flood_fe, flood_url = await h.add_frontend(**settings)
    started = time.perf_counter()
    await timed(flood_url, "key-flood", 4, started)  # the flood's frontend has read the shared counters once
    await timed(quiet_url, "key-quiet", 4, started)  # charged there: the flood's frontend sees it is active
    flood = [asyncio.create_task(timed(flood_url, "key-flood", LONG, started)) for _ in range(FLOOD)]

    async def flood_placed() -> bool:
        st = engine.stats()
        queued = flood_fe.metrics.tenant_queued.labels("flood")._value.get()
        return bool(st.running >= 1 and st.running + st.waiting + queued == FLOOD)

    await until(flood_placed, 30)
    sent = time.perf_counter() - started
    quiet_first, _ = await timed(quiet_url, "key-quiet", 4, started)
    async with asyncio.timeout(60):
        flood_t = await asyncio.gather(*flood)
    first_end = min(end for _, end in flood_t)
    assert quiet_first < first_end, (sent, quiet_first, sorted(flood_t))
