"""A finished request leaves nothing for the cycle collector: its objects are freed by reference counting.

Objects in reference cycles wait for the cycle collector, whose young collections then walk every one of
them; at a few hundred requests a second one cycle per request made the frontend's collections pause it
several times a second (docs/benchmarks.md, "Hot-path changes").
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import httpx
import pytest

from server.generation import Generation
from server.migration import Mover
from server.streams import ClientStream
from tests.harness import Harness, sse_events, until
from workers.serving import _Attempt

pytestmark = pytest.mark.integration

KINDS = (Generation, Mover, ClientStream, _Attempt)


def chat(stream: bool) -> dict[str, object]:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": "cycles"}],
        "max_tokens": 8,
        "stream": stream,
    }


def alive() -> list[str]:
    """The request objects the collector still tracks: live ones, and garbage only it could free."""
    return [type(o).__name__ for o in gc.get_objects() if isinstance(o, KINDS)]


@pytest.fixture
def no_cycle_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_finished_requests_are_freed_without_the_cycle_collector(h: Harness, no_cycle_collection: None) -> None:
    await h.add_worker()
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        for _ in range(3):
            assert (await c.post("/v1/chat/completions", json=chat(stream=False))).status_code == 200
            async with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                events = [e async for e in sse_events(r)]
            assert events[-1] == (None, "[DONE]")

    async def freed() -> bool:
        return not alive()

    # The handler closes its request just after the last event; with the collector off, only reference
    # counting can free what it held.
    try:
        await until(freed, timeout_s=5)
    except TimeoutError:
        raise AssertionError(f"still held after their requests ended: {sorted(alive())}") from None
