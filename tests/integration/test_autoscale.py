"""`ferry up --autoscale` on simulated workers: a burst makes the planner start workers; when it ends the planner
drains them again (SIGTERM, finish, exit 0) while streams keep running, and not one request fails."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from launch.services import Child
from tests.harness import Lines, sse_events, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MODEL = "SmolLM2-135M-Instruct"


async def stream(c: httpx.AsyncClient, max_tokens: int) -> str | None:
    """One streamed chat completion; None if it ended as it should, else what went wrong."""
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story " * 8}],
        "max_tokens": max_tokens, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
        events = [data async for _, data in sse_events(r)]
    if events[-1:] != ["[DONE]"]:
        return f"no [DONE]: {events[-2:]}"
    if any("error" in json.loads(d) for d in events[:-1]):
        return f"error event: {events[-3:]}"
    if json.loads(events[-2])["usage"]["completion_tokens"] != max_tokens:
        return f"short stream: {events[-2]}"
    return None


async def keep_streaming(
    c: httpx.AsyncClient, stop: asyncio.Event, max_tokens: int, out: list[str | None]
) -> None:
    while not stop.is_set():
        out.append(await stream(c, max_tokens))


@dataclasses.dataclass
class Autoscaled:
    """A running `ferry up --autoscale`: where it serves, its output lines, the streams sent and how they ended."""

    url: str
    lines: Lines
    banner: list[str]  # what it printed up to its ready line
    loops: list[asyncio.Task[None]] = dataclasses.field(default_factory=list)
    results: list[str | None] = dataclasses.field(default_factory=list)
    code: int | None = None  # its exit code, once stopped
    errors: list[str] = dataclasses.field(default_factory=list)  # its ERROR lines: why a request failed


@contextlib.asynccontextmanager
async def autoscaled(flags: list[str], model_path: Path) -> AsyncIterator[Autoscaled]:
    """`ferry up --autoscale` on sim workers with a planner interval of 1 s and `flags`; on the way out its
    streams are cancelled and it is stopped."""
    child = await Child.spawn(
        "ferry-up",
        [sys.executable, "-m", "launch", "up", "--autoscale", "--planner-interval-s", "1", "--port", "0",
         "--model-path", str(model_path), *flags],
        echo=bool(os.environ.get("FERRY_TEST_ECHO")),
    )  # fmt: skip
    run: Autoscaled | None = None
    try:
        url = (await child.wait_for_line(lambda line: line.startswith("ferry-ready "), 120)).split()[1]
        run = Autoscaled(url, Lines(child), list(child.tail))
        run.errors = run.lines.of(" ERROR ")
        yield run
    finally:
        if run is not None:
            for t in run.loops:
                t.cancel()
            await asyncio.gather(*run.loops, return_exceptions=True)
        code = await child.stop(60)
        if run is not None:
            run.lines.close()
            run.code = code


async def test_autoscale_scales_out_under_load_and_drains_back_without_a_failed_request(
    model_path: Path,
) -> None:
    flags = [
        "--workers", "1", "--min-workers", "1", "--max-workers", "3", "--scale-out-cooldown-s", "2",
        "--scale-in-cooldown-s", "10", "--scale-in-stable", "2", "--worker-capacity", "4", "--worker-start-s", "2",
        "--ttft-p90-target-s", "2", "--itl-p90-target-s", "0.2", "--speedup", "5",
    ]  # fmt: skip
    async with autoscaled(flags, model_path) as run:
        starts, drains = run.lines.of("planner: started worker-"), run.lines.of("drained and exited")
        crashes = run.lines.of("exited unexpectedly")
        async with httpx.AsyncClient(base_url=run.url, timeout=60) as c:
            burst, calm = asyncio.Event(), asyncio.Event()
            # A burst of short streams, and two long ones that go on while the planner drains workers.
            run.loops += [asyncio.create_task(keep_streaming(c, burst, 60, run.results)) for _ in range(24)]
            run.loops += [asyncio.create_task(keep_streaming(c, calm, 300, run.results)) for _ in range(2)]
            await run.lines.until(lambda: len(starts) >= 1, 60)
            await asyncio.sleep(5)  # the burst goes on a while on the larger fleet
            burst.set()
            # Back to the floor: every worker the planner started drained again.
            await run.lines.until(lambda: len(drains) >= len(starts), 120)
            calm.set()
            await asyncio.gather(*run.loops)
        assert all("code 0" in line for line in drains), drains
        assert not crashes, crashes
    failures = [r for r in run.results if r is not None]
    assert len(run.results) > 50 and not failures, (failures[:5], run.errors[:5])
    assert run.code == 0


async def test_autoscale_sizes_the_decode_pool_apart_from_the_prefill_pool(model_path: Path) -> None:
    # Many concurrent streams load the decode pool (each holds its sequence for 60 tokens), while the prefill
    # pool holds each only for its short prompt and meets its TTFT target: one pool grows, the other does not.
    # A worker's capacity of 6: the 16 streams' decodes pass it at once, their prefills (a few at a time, more on
    # a loaded machine: at 4 the prefill pool's forecast crossed it now and then) do not.
    flags = [
        "--workers", "0", "--prefill-workers", "1", "--decode-workers", "1", "--min-workers", "1",
        "--max-workers", "2", "--scale-out-cooldown-s", "2", "--scale-in-cooldown-s", "4", "--scale-in-stable", "2",
        "--worker-capacity", "6", "--worker-start-s", "2", "--ttft-p90-target-s", "2", "--itl-p90-target-s", "0.2",
        "--speedup", "5", "--monitor",
    ]  # fmt: skip
    async with autoscaled(flags, model_path) as run:
        decode_starts = run.lines.of("planner: started decode-")
        prefill_starts = run.lines.of("planner: started prefill-")
        drains, crashes = run.lines.of("drained and exited"), run.lines.of("exited unexpectedly")
        # The planners scrape every frontend each second: httpx must not log a line for each scrape.
        request_lines = run.lines.of("httpx: HTTP Request")
        async with httpx.AsyncClient(base_url=run.url, timeout=60) as c:
            burst = asyncio.Event()
            run.loops += [asyncio.create_task(keep_streaming(c, burst, 60, run.results)) for _ in range(16)]
            await run.lines.until(lambda: len(decode_starts) >= 1, 60)
            burst.set()
            await asyncio.gather(*run.loops)
            await run.lines.until(lambda: len(drains) >= len(decode_starts), 60)
        assert not prefill_starts, prefill_starts
        assert all("decode-1 drained and exited with code 0" in line for line in drains), drains
        assert not crashes, crashes
        # --monitor's Prometheus scrapes both planners, each series labelled with its pool.
        prometheus = next(ln.split()[1] for ln in run.banner if ln.startswith("Prometheus "))
        async with httpx.AsyncClient(base_url=prometheus, timeout=10) as p:

            async def both_planners() -> bool:
                r = await p.get("/api/v1/query", params={"query": "ferry_planner_desired_workers"})
                return {s["metric"].get("pool") for s in r.json()["data"]["result"]} == {"prefill", "decode"}

            await until(both_planners, 30)
        assert not request_lines, request_lines[:3]
    failures = [r for r in run.results if r is not None]
    assert len(run.results) >= 16 and not failures, (failures[:5], run.errors[:5])
    assert run.code == 0
