"""Coalesced rings (kvstore/bells.py): at most one per window, and one more at its end when asked meanwhile."""

from __future__ import annotations

import asyncio

from kvstore.bells import Coalesced

WINDOW_S = 0.05


async def test_rings_within_a_window_become_one_trailing_ring_at_its_end() -> None:
    loop = asyncio.get_running_loop()
    published: list[float] = []
    heard = asyncio.Event()

    def publish(channel: str) -> None:
        assert channel == "c"
        published.append(loop.time())
        heard.set()

    ring = Coalesced(publish, "c", WINDOW_S)
    ring.ring()
    assert len(published) == 1  # the first ring goes at once
    heard.clear()
    ring.ring()
    ring.ring()
    assert len(published) == 1  # asked twice within the window: one ring, at its end
    await asyncio.wait_for(heard.wait(), 5)
    assert len(published) == 2 and published[1] - published[0] >= WINDOW_S * 0.9
    assert ring.rung == 2


async def test_a_stopping_writer_drops_its_trailing_ring() -> None:
    published: list[str] = []
    ring = Coalesced(published.append, "c", WINDOW_S)
    ring.ring()
    ring.ring()
    ring.cancel()
    ring.ring()  # a new window's trailing ring can be asked for again
    ring.cancel()
    assert published == ["c"] and ring.rung == 1
