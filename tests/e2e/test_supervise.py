"""`ferry up` without --autoscale starts a worker again when it exits (as an engine death makes it do): the stack
serves on, and stops cleanly."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import httpx
import pytest

from bench.stack import stack_pids
from launch.services import Child
from schemas.settings import DEFAULT_MODEL_NAME as MODEL
from tests.harness import Lines, until

pytestmark = pytest.mark.e2e

BODY = {"model": MODEL, "prompt": "ferries cross the harbour", "max_tokens": 4}


async def test_a_worker_that_dies_is_started_again_and_the_stack_serves_on(model_path: Path) -> None:
    child = await Child.spawn(
        "ferry-up",
        [sys.executable, "-m", "launch", "up", "--port", "0", "--workers", "1", "--speedup", "20",
         "--model-path", str(model_path), "--heartbeat-interval-s", "0.5"],
        echo=False,
    )  # fmt: skip
    lines = Lines(child)
    try:
        url = (await child.wait_for_line(lambda ln: ln.startswith("ferry-ready "), 120)).split()[1]
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            assert (await c.post("/v1/completions", json=BODY)).status_code == 200
            first = stack_pids(child.proc.pid)["worker-0"]
            exited, back = lines.of("worker-0 exited unexpectedly with code -9"), lines.of("worker-0 is back")
            os.kill(first, signal.SIGKILL)
            await lines.until(lambda: bool(exited and back), 120)
            assert stack_pids(child.proc.pid)["worker-0"] != first

            async def served() -> bool:
                # The frontend may not have seen the new process register yet: 503 `no_workers` until it has.
                r = await c.post("/v1/completions", json=BODY)
                assert r.status_code in (200, 503), r.text
                return r.status_code == 200

            await until(served, 30, period_s=0.2)
    finally:
        lines.close()
        assert await child.stop(30) == 0, "\n".join(child.tail)
