"""Resumable streams: drop the connection mid-stream, reconnect with Last-Event-ID, get exactly the rest."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.harness import Harness, sse_events

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
RESUMABLE = {"x-ferry-resumable": "1"}
Event = tuple[str | None, str]


def chat(**kw: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "A long story, please"}],
        "max_tokens": 150,
        "ignore_eos": True,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        **kw,
    }


def text_of(events: list[Event]) -> str:
    out = []
    for _id, data in events:
        if data != "[DONE]":
            for ch in json.loads(data).get("choices", []):
                out.append(ch.get("delta", {}).get("content") or ch.get("text") or "")
    return "".join(out)


async def ready(c: httpx.AsyncClient, url: str) -> None:
    """Wait until the frontend at `url` sees a live worker (its registry view refreshes in the background)."""
    async with asyncio.timeout(20):
        for _ in iter(int, 1):
            if (await c.get(f"{url}/ready")).status_code == 200:
                return
            await asyncio.sleep(0.05)


async def read_some(
    c: httpx.AsyncClient, path: str, body: dict[str, object], k: int
) -> tuple[str, list[Event]]:
    """Start a resumable stream, read `k` events with output, then drop the connection."""
    events: list[Event] = []
    async with c.stream("POST", path, json=body, headers=RESUMABLE) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["x-ferry-resumable"] == "1"
        rid = r.headers["x-request-id"]
        async for e in sse_events(r):
            events.append(e)
            if len(events) == k:
                break
    return rid, events


async def test_dropped_stream_resumes_exactly_where_it_stopped(h: Harness) -> None:
    w = await h.add_worker(speedup=1.0)  # real time: the request is still running when dropped
    _fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=chat()) as r:
            reference = [e async for e in sse_events(r)]
        rid, head = await read_some(c, "/v1/chat/completions", chat(), 12)
        last = head[-1][0]
        assert last is not None
        # The client is gone, but the request was not cancelled: it keeps generating for a resume.
        assert w.worker.engine.stats().running == 1
        async with c.stream(
            "GET", f"/v1/chat/completions/{rid}/stream", headers={"last-event-id": last}
        ) as r:
            assert r.status_code == 200
            tail = [e async for e in sse_events(r)]
    stream = head + tail
    # Exactly the remaining events: ids continue without a gap or a repeat.
    ids = [int(i) for i, _ in stream if i is not None]
    assert ids == list(range(len(ids)))
    assert tail[-1] == (None, "[DONE]")
    assert text_of(stream) == text_of(reference)
    assert json.loads(stream[-2][1])["usage"] == json.loads(reference[-2][1])["usage"]
    assert all(json.loads(d)["id"] == rid for _, d in stream[:-1])


async def test_another_replica_replays_the_same_events(h: Harness) -> None:
    await h.add_worker()
    _fe1, url1 = await h.add_frontend()
    _fe2, url2 = await h.add_frontend()
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 30,
        "n": 2,
        "seed": 2,
        "stream": True,
        "echo": True,
        "stream_options": {"include_usage": True},
    }
    async with httpx.AsyncClient(timeout=60) as c:
        await ready(c, url1)
        await ready(c, url2)
        async with c.stream("POST", f"{url1}/v1/completions", json=body, headers=RESUMABLE) as r:
            rid = r.headers["x-request-id"]
            original = [e async for e in sse_events(r)]
        # Everything, from another frontend, after the request finished: the same events, same ids.
        async with c.stream("GET", f"{url2}/v1/completions/{rid}/stream") as r:
            replayed = [e async for e in sse_events(r)]
        assert replayed == original
        # From the middle: exactly the events after the one named.
        async with c.stream(
            "GET", f"{url2}/v1/completions/{rid}/stream", headers={"last-event-id": "7"}
        ) as r:
            rest = [e async for e in sse_events(r)]
        assert rest == [e for e in original if e[0] is None or int(e[0]) > 7]
        # The wrong kind of route, an unknown id, a malformed Last-Event-ID.
        assert (await c.get(f"{url2}/v1/chat/completions/{rid}/stream")).status_code == 404
        missing = await c.get(f"{url2}/v1/completions/cmpl-nope/stream")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "stream_not_found"
        bad = await c.get(f"{url2}/v1/completions/{rid}/stream", headers={"last-event-id": "x"})
        assert bad.status_code == 400


async def test_not_resumable_unless_asked_and_abandoned_streams_are_cancelled(h: Harness) -> None:
    w = await h.add_worker(speedup=1.0)
    _fe, url = await h.add_frontend(resume_grace_s=0.5)
    engine = w.worker.engine
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        # Default (OpenAI) behaviour: leaving cancels at once, and there is nothing to resume.
        async with c.stream("POST", "/v1/chat/completions", json=chat(max_tokens=2000)) as r:
            rid = r.headers["x-request-id"]
            assert "x-ferry-resumable" not in r.headers
            async for _e in sse_events(r):
                break
        await asyncio.wait_for(w.worker.idle.wait(), 10)
        assert (await c.get(f"/v1/chat/completions/{rid}/stream")).status_code == 404
        # Resumable, but nobody comes back within the grace period: cancelled then.
        rid, _head = await read_some(c, "/v1/chat/completions", chat(max_tokens=2000), 3)
        assert engine.stats().running == 1
        await asyncio.wait_for(w.worker.idle.wait(), 10)
        assert engine.stats().running == 0 and engine.stats().kv_usage == 0.0
        # What it produced can still be read back, ending with its abort.
        async with c.stream("GET", f"/v1/chat/completions/{rid}/stream") as r:
            events = [e async for e in sse_events(r)]
        assert events[-1] == (None, "[DONE]")
        assert json.loads(events[-2][1])["choices"] == []  # the usage chunk after the aborted choice
        assert len(text_of(events)) > 0
