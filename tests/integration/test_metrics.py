"""The metrics an SLO dashboard and an autoscaler read, each compared with what a client measured.

Real broker and Redis, sim workers with real-time steps (speedup 1), the frontend on uvicorn; the client
timestamps every SSE event it receives and the test holds the frontend's and workers' figures against them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from planner.latency import FrontendScraper, Latency, registered_frontends
from server.frontend import Frontend
from tests.harness import Harness, sse_events, until, worker_process

pytestmark = pytest.mark.integration

MODEL = "SmolLM2-135M-Instruct"
# How far a server-side figure may be from the client's: the client reads each event a little later (one
# loopback hop and the SSE framing), and a test machine shared with other work adds jitter.
SLACK_S = 0.06


def near(server: float, client: float, rel: float = 0.1) -> bool:
    """`server` agrees with `client` within the slack."""
    return abs(server - client) <= SLACK_S + rel * client


@dataclass
class Measured:
    """One streamed request as the client saw it (perf_counter times)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    done: float = 0.0
    usage: dict[str, int] = field(default_factory=dict)
    error: dict[str, str] | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent


def body(max_tokens: int, content: str = "Tell me about ferries", **kw: object) -> dict[str, object]:
    return {
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **kw,
    }  # fmt: skip


async def stream(c: httpx.AsyncClient, payload: dict[str, object], started: asyncio.Event | None = None) -> Measured:
    """Send one streamed request, timestamping every event with tokens and the final [DONE]."""
    m = Measured(time.perf_counter())
    async with c.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200, await r.aread()
        async for _id, data in sse_events(r):
            now = time.perf_counter()
            if data == "[DONE]":
                m.done = now
                continue
            event = json.loads(data)
            if "error" in event:
                m.error = event["error"]
            elif event.get("usage"):
                m.usage = event["usage"]
            elif any(ch["delta"].get("content") for ch in event["choices"]):
                m.token_times.append(now)
                if started is not None:
                    started.set()
    return m


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """One sample's value (0 if absent)."""
    return registry.get_sample_value(name, labels) or 0.0


def fe_value(fe: Frontend, name: str, **labels: str) -> float:
    """One of the frontend's samples, by default of MODEL."""
    return value(fe.metrics.registry, name, **({"model": MODEL} | labels))


async def test_latencies_and_lengths_match_the_client(h: Harness) -> None:
    w = await h.add_worker(speedup=1.0)
    fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        await stream(c, body(3))  # warm up: the first request of a process pays one-off costs on both sides
        before = Figures(fe, w.worker.metrics.registry)
        m = await stream(c, body(40))
    d = before.delta
    n = m.usage["completion_tokens"]
    assert n == 40 and m.error is None
    # TTFT counts from the request's arrival to its first token; the client's includes one hop more.
    assert d("ferry_time_to_first_token_seconds_count") == 1
    assert near(d("ferry_time_to_first_token_seconds_sum"), m.ttft)
    # One inter-token observation per token after the first, together spanning first to last token.
    assert d("ferry_inter_token_latency_seconds_count") == n - 1
    client_span = m.token_times[-1] - m.token_times[0]
    assert near(d("ferry_inter_token_latency_seconds_sum"), client_span)
    # End to end at the end of the stream, not when the response object was returned.
    assert d("ferry_request_duration_seconds_count") == 1
    assert near(d("ferry_request_duration_seconds_sum"), m.e2e)
    assert m.e2e > 0.2  # 40 real-time decode steps: a stream long enough for the check above to mean something
    # Prefill and decode as the worker timed them; queue + prefill fit in the TTFT.
    assert near(d("ferry_request_decode_seconds_sum"), client_span)
    queued_and_prefill = d("ferry_request_queue_seconds_sum") + d("ferry_request_prefill_seconds_sum")
    assert 0 < queued_and_prefill <= m.ttft
    # Lengths as the client's usage says.
    assert d("ferry_request_prompt_tokens_sum") == m.usage["prompt_tokens"]
    assert d("ferry_request_completion_tokens_sum") == n
    assert near(d("ferry_worker_decode_seconds_sum", worker=True), client_span)
    assert d("ferry_worker_decode_seconds_count", worker=True) == 1


class Figures:
    """The frontend's (MODEL's) and a worker's samples at one moment, to take differences from."""

    def __init__(self, fe: Frontend, worker: CollectorRegistry) -> None:
        self._fe, self._worker = fe, worker
        self._then = {(s.name, k): s.value for k, reg in (("fe", fe.metrics.registry), ("w", worker))
                      for f in reg.collect() for s in f.samples if s.labels in ({}, {"model": MODEL})}  # fmt: skip

    def delta(self, name: str, worker: bool = False) -> float:
        """How much a sample grew since."""
        now = value(self._worker, name) if worker else fe_value(self._fe, name)
        return now - self._then.get((name, "w" if worker else "fe"), 0.0)


async def test_queue_time_is_frontend_wait_plus_engine_queue(h: Harness) -> None:
    await h.add_worker(speedup=1.0, max_num_seqs=1)  # one sequence at a time: the second one queues
    fe, url = await h.add_frontend()
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        first_started = asyncio.Event()
        first = asyncio.create_task(stream(c, body(60), first_started))
        await first_started.wait()
        second = await stream(c, body(5, "Another question"))
        a = await first
        queued = fe_value(fe, "ferry_request_queue_seconds_sum")
        busy = queued + fe_value(fe, "ferry_request_prefill_seconds_sum")
        # A third request alone: what its TTFT holds besides queue and prefill (the hops through the broker).
        alone = await stream(c, body(5, "A third question"))
        hops = alone.ttft - (fe_value(fe, "ferry_request_queue_seconds_sum") + fe_value(
            fe, "ferry_request_prefill_seconds_sum") - busy)  # fmt: skip
    # The client saw the second wait from when it sent it until the first's last token, less the hops of
    # its request to the worker and of the first's last token back.
    waited = a.token_times[-1] - second.sent
    assert waited > 0.2
    assert fe_value(fe, "ferry_request_queue_seconds_count") == 3
    assert near(queued, waited - hops, rel=0.15)


async def test_wait_queue_depth_counts_requests_waiting_for_a_worker(h: Harness) -> None:
    await h.add_worker(speedup=1.0, max_num_seqs=1)
    # A worker with a waiting request is busy: a third request waits in the frontend.
    fe, url = await h.add_frontend(busy_waiting=1, busy_wait_s=30.0)
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        started = asyncio.Event()
        # Long enough (~2 s of 1-sequence steps) that the queued request waits in the engine across several
        # heartbeats (0.5 s apart): at 80 tokens it waited ~0.5 s, and a heartbeat could miss it.
        running = asyncio.create_task(stream(c, body(400), started))
        await started.wait()
        queued = asyncio.create_task(stream(c, body(2, "queued in the engine")))
        await until(lambda: _engine_waiting(fe), 10)
        waiting = asyncio.create_task(stream(c, body(2, "queued in the frontend")))
        await until(lambda: _depth(fe, 1), 10)
        assert not waiting.done()  # the client has no answer yet: it is the one waiting
        await asyncio.gather(running, queued, waiting)
    assert fe.metrics.registry.get_sample_value("ferry_router_queue_depth") == 0
    assert fe.metrics.registry.get_sample_value("ferry_router_busy_waits_total", {"outcome": "served"}) == 1


async def _engine_waiting(fe: Frontend) -> bool:
    await fe.pool.refresh()
    return any(w.waiting > 0 for w in fe.pool.workers.values())


async def _depth(fe: Frontend, n: int) -> bool:
    return fe.metrics.registry.get_sample_value("ferry_router_queue_depth") == n


async def test_prefix_cache_counters_match_the_cached_tokens_clients_were_told(h: Harness) -> None:
    w = await h.add_worker(speedup=50.0)
    _fe, url = await h.add_frontend()
    system = "You are a meticulous geography tutor. " * 40
    prompt, cached = 0, 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for q in ("France?", "Spain?", "Italy?"):
            payload = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "system", "content": system},
                                                                     {"role": "user", "content": q}]}  # fmt: skip
            usage = (await c.post("/v1/chat/completions", json=payload)).json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
    wr = w.worker.metrics.registry
    assert cached >= 2 * 64  # the later requests found the shared prefix
    assert value(wr, "ferry_worker_prefix_cache_queries_total") == prompt
    assert value(wr, "ferry_worker_prefix_cache_hits_total") == cached


async def test_in_stream_errors_and_migrations_are_counted(
    h: Harness, kafka: str, redis_url: str, prefix: str, model_path: Path
) -> None:
    ids = [f"met-{i}-{prefix.rstrip(':')}" for i in range(2)]
    children = dict(zip(ids, await asyncio.gather(*(
        worker_process(wid, kafka, redis_url, prefix, model_path, "--speedup", "1") for wid in ids
    )), strict=True))  # fmt: skip
    try:
        fe, url = await h.add_frontend(busy_wait_s=1.0)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            for expect_error in (False, True):
                # The first kill moves the stream to the other worker; the second leaves nowhere to go.
                started = asyncio.Event()
                task = asyncio.create_task(stream(c, body(150), started))
                await started.wait()
                await until(lambda: _running_somewhere(fe, children), 10)
                victim = next(wid for wid, w in fe.pool.workers.items() if w.running and wid in children)
                children.pop(victim).kill()
                m = await asyncio.wait_for(task, 30)
                assert (m.error is not None) is expect_error, m.error
        assert m.error is not None and m.error["code"] == "worker_died"
        migrations = "ferry_migrations_total"
        assert value(fe.metrics.registry, migrations, reason="worker_died", outcome="moved") == 1
        assert value(fe.metrics.registry, migrations, reason="worker_died", outcome="failed") == 1
        assert fe_value(fe, "ferry_request_errors_total", type="worker_died", stage="stream") == 1
        # Only the stream that succeeded has an end-to-end latency.
        assert fe_value(fe, "ferry_request_duration_seconds_count") == 1
    finally:
        await asyncio.gather(*(ch.stop() for ch in children.values()), return_exceptions=True)


async def _running_somewhere(fe: Frontend, children: Mapping[str, object]) -> bool:
    await fe.pool.refresh()
    return any(w.running for wid, w in fe.pool.workers.items() if wid in children)


async def _worker_samples(c: httpx.AsyncClient, url: str, wid: str) -> list[Any]:
    """The `ferry_` samples at `url` once they hold the worker's consumer lag: set at each heartbeat, from the
    inbox's first fetch on."""
    async with asyncio.timeout(10):
        while True:
            text = (await c.get(url)).text
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("ferry_")]
            if any(s.name == "ferry_kafka_consumer_lag" and s.labels["topic"].endswith(wid) for s in samples):
                return samples
            await asyncio.sleep(0.05)


async def test_discovery_lists_every_live_process_and_their_metrics_agree(h: Harness) -> None:
    workers = [await h.add_worker(), await h.add_worker()]
    fe, url = await h.add_frontend()
    fe2, _url2 = await h.add_frontend()
    await fe.pool.refresh()
    await fe2.pool.refresh()  # each announces itself with its refresh
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        groups = (await c.get("/discovery/prometheus")).json()
        by_id = {g["labels"]["ferry_id"]: g for g in groups}
        assert set(by_id) == {fe.settings.frontend_id, fe2.settings.frontend_id} | {
            w.worker.settings.worker_id for w in workers
        }
        for w in workers:
            wid = w.worker.settings.worker_id
            g = by_id[wid]
            assert g["labels"]["role"] == "worker"
            # The advertised address is where the worker's metrics really are, labelled with model and worker.
            samples = await _worker_samples(c, f"http://{g['targets'][0]}{g['labels']['__metrics_path__']}", wid)
            assert samples and all(s.labels["worker"] == wid and s.labels["model"] == MODEL for s in samples)
        front = by_id[fe.settings.frontend_id]
        assert front["labels"]["role"] == "frontend" and front["targets"] == [url.removeprefix("http://")]
        # A worker that stops drops out of the next answer, and its /metrics server is gone with it.
        stopped = workers[1].worker.heartbeat.metrics_url
        await workers[1].stop()
        await fe.pool.refresh()
        groups = (await c.get("/discovery/prometheus")).json()
        assert workers[1].worker.settings.worker_id not in {g["labels"]["ferry_id"] for g in groups}
        with pytest.raises(httpx.ConnectError):
            await c.get(stopped)
    # The frontend's own replies reader reports its lag.
    assert any(
        s.name == "ferry_kafka_consumer_lag" for f in fe.metrics.registry.collect() for s in f.samples
    )


async def test_the_planner_reads_the_latency_of_every_frontend_in_the_registry(h: Harness) -> None:
    await h.add_worker()
    fe, url = await h.add_frontend()
    fe2, url2 = await h.add_frontend()
    await fe.pool.refresh()
    await fe2.pool.refresh()  # each announces itself with its refresh
    async with httpx.AsyncClient(timeout=30) as c:
        scraper = FrontendScraper(c, registered_frontends(fe.pool.registry, MODEL), MODEL)
        assert await scraper.read(0.0) == Latency(None, None, None)  # the first scrape is the baseline
        for base in (url, url, url2):
            async with httpx.AsyncClient(base_url=base, timeout=30) as fc:
                assert (await stream(fc, body(4))).error is None
        got = await scraper.read(10.0)
    # Three first tokens in 10 s across both frontends: one listed by hand would give 0.2 or 0.1.
    assert got.arrival_rate == pytest.approx(0.3)
    assert got.ttft_p90_s is not None and got.itl_p90_s is not None
