"""A worker's inbox waits longer per fetch while its engine is busy (half a step), and goes back to the
prompt wait once idle."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.harness import Harness, until
from workers.inbox import fetch_wait_ms
from workers.worker import Worker

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"


async def test_a_busy_workers_inbox_waits_half_a_step_per_fetch(h: Harness) -> None:
    # A quarter of real time: ~23 ms decode steps, so half a step is above the 5 ms base.
    running = await h.add_worker(speedup=0.25)
    worker = running.worker
    _, url = await h.add_frontend()
    fetcher = worker._inbox.reader.consumer._fetcher
    base = worker.settings.kafka_fetch_wait_ms
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 40, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        first = await c.post("/v1/completions", json=body)  # measures the step
        assert first.status_code == 200
        step_s = worker.serving.step_s
        assert 0.01 < step_s < 0.2, step_s
        expected = fetch_wait_ms(base, worker.settings.busy_fetch_wait_ms, True, step_s)
        assert expected > base
        second = asyncio.create_task(c.post("/v1/completions", json=body))

        async def paced() -> bool:
            return fetcher._fetch_max_wait_ms > base

        await until(paced, 10, 0.005)
        assert base < fetcher._fetch_max_wait_ms <= worker.settings.busy_fetch_wait_ms
        assert (await second).status_code == 200

    async def prompt_again() -> bool:
        return fetcher._fetch_max_wait_ms == base

    await until(prompt_again, 10)


async def test_no_pacing_while_every_request_in_flight_ends_at_its_next_output(h: Harness) -> None:
    # A one-token request's prefill is its last step: a request arriving as it ends would find the engine
    # idle, so a paced fetch would only delay it (the closed loop of bench.routing's unloaded probe).
    running = await h.add_worker(speedup=0.25)
    worker = running.worker
    _, url = await h.add_frontend()
    base = worker.settings.kafka_fetch_wait_ms
    waits: list[tuple[int, int]] = []  # (requests in flight, fetch wait) at every poll
    set_wait = worker._inbox.reader.set_fetch_wait

    def record(wait_ms: int) -> None:
        waits.append((len(worker.serving), wait_ms))
        set_wait(wait_ms)

    worker._inbox.reader.set_fetch_wait = record  # type: ignore[method-assign]
    long_prompt = " ".join(["word"] * 1500)  # a prefill of ~100 ms at this speedup: several polls
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        first = await c.post("/v1/completions", json={"model": MODEL, "prompt": "Count", "max_tokens": 40})
        assert first.status_code == 200 and worker.serving.step_s > 0.01  # pacing would apply when busy
        waits.clear()
        one = await c.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1})
        assert one.status_code == 200
        busy = [w for n, w in waits if n > 0]
        assert busy and set(busy) == {base}, waits
        # Two tokens to go: paced again, so the rule is not simply "never".
        waits.clear()
        two = await c.post(
            "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 8, "ignore_eos": True}
        )
        assert two.status_code == 200
        assert any(n > 0 and w > base for n, w in waits), waits


async def test_a_busy_workers_inbox_sleeps_between_requests_and_rings_wake_it(h: Harness) -> None:
    # A busy engine does not keep the inbox fetching: requests and cancels ring it (bus/doorbell.py).
    running = await h.add_worker(speedup=0.25)
    worker = running.worker
    _, url = await h.add_frontend()
    reader = worker._inbox.reader
    body = {"model": MODEL, "prompt": "Count", "max_tokens": 80, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        first = asyncio.create_task(c.post("/v1/completions", json=body))
        await until(lambda: _busy(worker), 10, 0.005)
        slept = reader.sleeps
        await until(lambda: _slept_while_busy(worker, slept), 10, 0.005)
        second = await c.post("/v1/completions", json={**body, "max_tokens": 4})  # read on its ring
        assert second.status_code == 200 and worker.serving.busy_after_step
        assert (await first).status_code == 200


async def _busy(worker: Worker) -> bool:
    return worker.serving.busy_after_step


async def _slept_while_busy(worker: Worker, before: int) -> bool:
    return worker._inbox.reader.sleeps > before and worker.serving.busy_after_step
