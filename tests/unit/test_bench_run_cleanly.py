"""A benchmark killed with SIGTERM stops what it started: `bench.stack.run_cleanly` turns the signal into a
cancellation, so the benchmark's `finally` blocks stop its stacks (whose processes run in sessions of their
own, and outlived a plain SIGTERM)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]

BENCH = """
import asyncio, sys
from bench.stack import run_cleanly
from launch.services import Child

async def main() -> None:
    child = await Child.spawn("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], echo=False)
    try:
        print(f"started {child.proc.pid}", flush=True)
        await asyncio.sleep(60)
    finally:
        await child.stop(5.0)
        print("stopped", flush=True)

run_cleanly(main(), uv={uv})
"""


def _run_and_terminate(uv: bool) -> tuple[int, str, int]:
    bench = subprocess.Popen(
        [sys.executable, "-c", BENCH.replace("{uv}", str(uv))],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert bench.stdout is not None
    line = bench.stdout.readline()
    assert line.startswith("started "), (line, bench.stderr.read() if bench.stderr else "")
    sleeper = int(line.split()[1])
    bench.send_signal(signal.SIGTERM)
    out, _ = bench.communicate(timeout=30)
    return bench.returncode, out, sleeper


def test_sigterm_stops_what_the_benchmark_started() -> None:
    for uv in (False, True):
        code, out, sleeper = _run_and_terminate(uv)
        assert "stopped" in out
        assert code == 128 + signal.SIGTERM  # as a process killed by it exits, after its clean-up
        assert not psutil.pid_exists(sleeper) or psutil.Process(sleeper).status() == psutil.STATUS_ZOMBIE
