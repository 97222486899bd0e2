"""The frontend's worker registry view stops in bounded time, and says where a refresh would not end."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from server import pool as pool_module
from server.metrics import FrontendMetrics
from server.pool import WorkerPool


class _StuckRegistry:
    """A registry whose read ignores its first cancel, as a call that swallows one would."""

    def __init__(self) -> None:
        self.reading = asyncio.Event()
        self.release = asyncio.Event()

    async def view(self) -> Any:
        self.reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await self.release.wait()
        raise RuntimeError("never read")


async def test_stop_leaves_a_refresh_that_ignores_its_cancel_and_logs_where_it_waits(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(pool_module, "STOP_WAIT_S", 0.05)
    registry = _StuckRegistry()
    pool = WorkerPool(registry, 0.001, FrontendMetrics(), lambda _w, _r: None)  # type: ignore[arg-type]
    pool._task = asyncio.create_task(pool._loop())
    await registry.reading.wait()
    with caplog.at_level(logging.WARNING, logger="ferry.frontend"):
        async with asyncio.timeout(5):
            await pool.stop()
    assert "did not end" in caplog.text and "in view" in caplog.text  # the await chain names the stuck call
    registry.release.set()  # it swallowed the cancel: its loop goes on until cancelled again
    pool._task.cancel()
    await asyncio.gather(pool._task, return_exceptions=True)


async def test_stop_waits_for_a_refresh_that_ends_on_its_cancel() -> None:
    class _Registry:
        async def view(self) -> Any:
            await asyncio.sleep(3600)

    pool = WorkerPool(_Registry(), 0.001, FrontendMetrics(), lambda _w, _r: None)  # type: ignore[arg-type]
    pool._task = asyncio.create_task(pool._loop())
    await asyncio.sleep(0.01)
    await pool.stop()
    assert pool._task.done()
