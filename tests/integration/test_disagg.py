"""Disaggregated prefill and decode end to end: sim workers with roles, the real broker and Redis.

A sequence starts on a prefill worker (its first token) and continues on a decode worker, which receives
the prompt's KV instead of computing it; the client reads one stream, the same as aggregated serving gives.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from server.frontend import Frontend
from server.migration import Mover
from tests.harness import Harness, RunningWorker, sse_events, until
from workers.sim import SimEngine

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
# Prompts longer than a block (64 tokens), so the decode worker has KV to receive.
LONG = "Tell me everything about ferries, their routes, their crews and their history. " * 8


def body(max_tokens: int = 40, **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": kw.pop("content", LONG)}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        **kw,
    }


async def read(
    url: str, b: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[httpx.Headers, list[tuple[str | None, str]]]:
    async with (
        httpx.AsyncClient(base_url=url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=b, headers=headers) as r,
    ):
        assert r.status_code == 200, await r.aread()
        async with asyncio.timeout(30):  # never a hang
            return r.headers, [e async for e in sse_events(r)]


def text_of(events: list[tuple[str | None, str]]) -> str:
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    return "".join(ch["delta"].get("content", "") for c in chunks for ch in c.get("choices", []))


def assert_complete(events: list[tuple[str | None, str]], completion_tokens: int) -> None:
    """One stream: no error, SSE ids 0, 1, 2, ... without a gap, a `length` finish, every token counted."""
    assert not any('"error"' in d for _, d in events), events[-3:]
    ids = [int(i) for i, _ in events if i is not None]
    assert ids == list(range(len(ids))), ids
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert finals[-1] == "length" and set(finals[:-1]) == {None}
    assert chunks[-1]["usage"]["completion_tokens"] == completion_tokens


def generated(w: RunningWorker) -> float:
    return w.worker.metrics.generated_tokens._value.get()


def wid(w: RunningWorker) -> str:
    return w.worker.settings.worker_id


async def sees(fe: Frontend, *workers: RunningWorker) -> None:
    async def all_live() -> bool:
        await fe.svc.pool.refresh()
        live = {w.worker_id for w in fe.svc.pool.live(MODEL)}
        return all(wid(w) in live for w in workers)

    await until(all_live, 10)


async def test_disaggregated_stream_is_the_aggregated_one_with_its_first_token_from_the_prefill_worker(
    h: Harness,
) -> None:
    prefill = await h.add_worker(role="prefill")
    decode = await h.add_worker(role="decode")
    _, disagg_url = await h.add_frontend()
    # A second frontend over the same workers whose threshold makes every prompt "short": it prefills on the
    # decode worker itself (conditional disaggregation), i.e. serves aggregated: the reference.
    _, local_url = await h.add_frontend(disagg_min_uncached_tokens=1_000_000)
    headers, events = await read(disagg_url, body(), {"x-ferry-resumable": "1"})
    assert headers["x-ferry-disagg"] == "remote"
    assert headers["x-ferry-worker"] == wid(prefill)
    assert headers["x-ferry-decode-worker"] == wid(decode)
    assert_complete(events, 40)
    # The first token was the prefill worker's, the other 39 the decode worker's.
    assert (generated(prefill), generated(decode)) == (1, 39)
    # The decode worker received the whole prompt's KV, the last block partial (nothing was cached there).
    engine = decode.worker.engine
    assert isinstance(engine, SimEngine)
    prompt_tokens = json.loads(events[-2][1])["usage"]["prompt_tokens"]
    assert engine.receiver.received_blocks == -(-prompt_tokens // 64) > 1

    ref_headers, reference = await read(local_url, body())
    assert ref_headers["x-ferry-disagg"] == "local"
    assert ref_headers["x-ferry-worker"] == ref_headers["x-ferry-decode-worker"] == wid(decode)
    assert_complete(reference, 40)
    assert (generated(prefill), generated(decode)) == (1, 79)  # served whole on the decode worker
    assert text_of(events) == text_of(reference)
    # The hand-off is a move in the replies topic too: another replica replays the same events.
    async with httpx.AsyncClient(base_url=local_url, timeout=60) as c:
        async with c.stream("GET", f"/v1/chat/completions/{headers['x-request-id']}/stream") as r:
            assert r.status_code == 200
            assert [e async for e in sse_events(r)] == events
    # Each choice of n is placed on its own; the replay holds each first token back as the live stream did.
    headers, events = await read(disagg_url, body(n=2), {"x-ferry-resumable": "1"})
    assert headers["x-ferry-disagg"] == "remote,remote"
    assert headers["x-ferry-decode-worker"] == f"{wid(decode)},{wid(decode)}"
    assert not any('"error"' in d for _, d in events)
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 80
    assert (generated(prefill), generated(decode)) == (1 + 2, 79 + 2 * 39)
    async with httpx.AsyncClient(base_url=local_url, timeout=60) as c:
        async with c.stream("GET", f"/v1/chat/completions/{headers['x-request-id']}/stream") as r:
            assert [e async for e in sse_events(r)] == events


async def test_the_first_token_waits_for_the_decode_worker_unless_the_frontend_sends_it_early(
    h: Harness,
) -> None:
    prefill = await h.add_worker(role="prefill")
    decode = await h.add_worker(role="decode")
    fe, url = await h.add_frontend()
    early, early_url = await h.add_frontend(disagg_first_token="prefill")
    await sees(fe, prefill, decode)
    await sees(early, prefill, decode)
    engine = decode.worker.engine
    assert isinstance(engine, SimEngine)

    def step_again() -> None:
        engine.hung = False
        engine._wake.set()

    # The decode worker takes the hand-off but its engine does not step, so does not start the sequence.
    engine.hung = True
    async with (
        httpx.AsyncClient(base_url=early_url, timeout=60) as c,
        c.stream("POST", "/v1/chat/completions", json=body()) as r,
    ):
        stream = sse_events(r)
        got: list[tuple[str | None, str]] = []
        async with asyncio.timeout(30):
            while not text_of(got):
                got.append(await anext(stream))
        # Sent early: the client has the prefill worker's token before the decode worker started.
        assert generated(prefill) == 1 and generated(decode) == 0
        step_again()
        got += [e async for e in stream]
    assert_complete(got, 40)

    # By default the frontend holds it until the decode worker's engine takes the sequence into a step.
    engine.hung = True
    reading = asyncio.create_task(read(url, body()))

    async def held() -> bool:
        streams = list(fe.svc.demux._by_request.values())
        return any(q.held is not None for s in streams for q in s.sequences.values())

    await until(held, 30)
    assert generated(prefill) == 2 and not reading.done()
    step_again()
    _, events = await reading
    assert_complete(events, 40)
    assert text_of(events) == text_of(got)


async def test_the_prefill_worker_releases_the_decode_attempt_without_the_frontend(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Decode-first: the decode attempt waits parked on its worker from the start, and the prefill worker's
    # Release starts it; the frontend's own hand-off only writes the marker. Without that hand-off the
    # stream still completes, the decode worker's chunks switching it over by themselves.
    monkeypatch.setattr(Mover, "hand_off", lambda self, seq: None)
    prefill = await h.add_worker(role="prefill")
    decode = await h.add_worker(role="decode")
    fe, url = await h.add_frontend()
    _, local_url = await h.add_frontend(disagg_min_uncached_tokens=1_000_000)
    headers, events = await read(url, body())
    assert headers["x-ferry-disagg"] == "remote"
    assert_complete(events, 40)
    assert (generated(prefill), generated(decode)) == (1, 39)
    assert fe.metrics.migrations.labels("handoff", "moved")._value.get() == 0
    _, reference = await read(local_url, body())
    assert text_of(events) == text_of(reference)
    assert len(decode.worker.serving.parking) == 0


async def test_short_prompt_is_prefilled_on_the_decode_worker(h: Harness) -> None:
    prefill = await h.add_worker(role="prefill")
    decode = await h.add_worker(role="decode")
    _, url = await h.add_frontend(disagg_min_uncached_tokens=100)
    headers, events = await read(url, body(content="Hi"))
    assert headers["x-ferry-disagg"] == "local"
    assert headers["x-ferry-worker"] == wid(decode)
    assert_complete(events, 40)
    assert (generated(prefill), generated(decode)) == (0, 40)
    # A long one still goes to the prefill worker.
    headers, events = await read(url, body())
    assert headers["x-ferry-disagg"] == "remote" and headers["x-ferry-worker"] == wid(prefill)
    assert_complete(events, 40)


async def test_client_leaving_mid_decode_stops_the_decode_worker(h: Harness) -> None:
    await h.add_worker(role="prefill")
    # Real-time steps: 2,000 tokens would take seconds, so the sequence is still decoding when the client leaves.
    decode = await h.add_worker(role="decode", speedup=1.0)
    _, url = await h.add_frontend()
    engine = decode.worker.engine
    assert isinstance(engine, SimEngine)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body(2000)) as r:
            assert r.headers["x-ferry-disagg"] == "remote"
            n = 0
            async with asyncio.timeout(30):
                async for _ in sse_events(r):
                    n += 1
                    if n == 6:  # role, the prefill worker's token, and some of the decode worker's
                        break

    async def stopped() -> bool:
        return engine.stats().running == 0 and engine.stats().waiting == 0

    await until(stopped, 10)
    requests = decode.worker.metrics.requests
    assert requests.labels("aborted")._value.get() == 1
    assert generated(decode) < 1999


async def test_prefill_worker_lost_before_its_token_is_migrated(h: Harness) -> None:
    prefill = await h.add_worker(role="prefill", canary_wait_s=0, heartbeat_interval_s=2.0)
    decode = await h.add_worker(role="decode")
    fe, url = await h.add_frontend()
    _, local_url = await h.add_frontend(disagg_min_uncached_tokens=1_000_000)
    await sees(fe, prefill, decode)
    _, reference = await read(local_url, body())
    engine = prefill.worker.engine
    assert isinstance(engine, SimEngine)
    engine.crash = True  # its step loop dies at the next step: the request's, before any token
    headers, events = await read(url, body())
    assert headers["x-ferry-worker"] == wid(prefill)
    assert_complete(events, 40)
    assert text_of(events) == text_of(reference)
    assert generated(prefill) == 0
    assert fe.metrics.migrations.labels("engine_died", "moved")._value.get() == 1
    assert fe.metrics.migrations.labels("handoff", "moved")._value.get() == 0  # an ordinary move


async def test_decode_worker_lost_mid_stream_is_migrated(h: Harness) -> None:
    await h.add_worker(role="prefill")
    decoders = [await h.add_worker(role="decode", speedup=5.0, canary_wait_s=0, heartbeat_interval_s=2.0)
                for _ in range(2)]  # fmt: skip
    fe, url = await h.add_frontend()
    _, local_url = await h.add_frontend(disagg_min_uncached_tokens=1_000_000)
    await sees(fe, *decoders)
    _, reference = await read(local_url, body(120))
    events: list[tuple[str | None, str]] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        async with c.stream("POST", "/v1/chat/completions", json=body(120)) as r:
            victim = next(d for d in decoders if wid(d) == r.headers["x-ferry-decode-worker"])
            engine = victim.worker.engine
            assert isinstance(engine, SimEngine)
            async with asyncio.timeout(30):
                async for e in sse_events(r):
                    events.append(e)
                    if len(events) == 10:
                        engine.crash = True
    assert_complete(events, 120)
    assert text_of(events) == text_of(reference)
    assert fe.metrics.migrations.labels("handoff", "moved")._value.get() == 1
    assert fe.metrics.migrations.labels("engine_died", "moved")._value.get() == 1
    assert await asyncio.wait_for(victim.task, 30) == 1  # its engine did die


async def test_a_decode_worker_gone_before_the_token_is_replaced_and_the_held_token_still_goes_out(
    h: Harness,
) -> None:
    prefill = await h.add_worker(role="prefill")
    decoders = [await h.add_worker(role="decode") for _ in range(2)]
    fe, url = await h.add_frontend()
    await sees(fe, prefill, *decoders)
    engine = prefill.worker.engine
    assert isinstance(engine, SimEngine)
    engine.hung = True  # no token until the decode worker it was placed with is gone
    reading = asyncio.create_task(read(url, body()))

    async def parked() -> bool:
        return any(len(d.worker.serving.parking) for d in decoders)

    await until(parked, 30)
    victim, other = sorted(decoders, key=lambda d: -len(d.worker.serving.parking))
    await victim.halt()

    async def gone() -> bool:
        return wid(victim) not in {w.worker_id for w in fe.svc.pool.live(MODEL)}

    await until(gone, 30)
    engine.hung = False
    engine._wake.set()
    # The frontend hands the sequence over itself, to the other decode worker, which sends no copy of the
    # token: the held token goes out with that worker's first chunk (it waited for nothing else).
    headers, events = await reading
    assert headers["x-ferry-decode-worker"] == wid(victim)
    assert_complete(events, 40)
    assert (generated(prefill), generated(other)) == (1, 39)
