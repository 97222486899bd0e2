"""Open-loop replay of a workload against an OpenAI-compatible server, one streamed request per work item.

Requests leave at their arrival times whatever the server is doing (an open loop, like independent users), on
keep-alive connections from a pool (`bench.sse_client.Connection`, one request at a time each). Every
request is a streamed `/v1/completions` call with a token-id prompt, `ignore_eos` and `max_tokens`, so every
server generates the same lengths; the usage chunk (`stream_options.include_usage`) gives prompt, completion
and cached prompt tokens as the engine reported them.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from bench.sse_client import Connection, Response, stream_stats
from bench.workload import WorkItem


class _Details(msgspec.Struct):
    cached_tokens: int | None = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _UsageChunk(msgspec.Struct):
    usage: _Usage | None = None


_usage_decoder = msgspec.json.Decoder(_UsageChunk)


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds."""

    index: int
    scheduled: float  # arrival time in the workload
    lateness: float  # how much later than scheduled the request was written
    ok: bool
    status: int = 0
    error: str | None = None
    ttft: float = math.nan
    itls: list[float] = field(default_factory=list)
    e2e: float = math.nan
    finished_at: float = math.nan  # since the start of the run
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker: str | None = None  # the worker that served it, where the server says


@dataclass
class ReplayResult:
    """All requests of one run and its timing."""

    results: list[RequestResult]
    wall_s: float  # first request written -> last response finished (or the deadline)
    not_sent: int  # items the run's deadline or the in-flight cap left unsent


def request_body(model: str, item: WorkItem, extra: dict[str, Any] | None = None) -> bytes:
    """The JSON body of one work item (plus `extra` fields, e.g. Dynamo's `nvext`)."""
    return msgspec.json.encode(
        {
            "model": model,
            "prompt": item.prompt,
            "max_tokens": item.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **(extra or {}),
        }
    )


_DYNAMO_WORKER = b'"decode_worker_id":'


def _worker(resp: Response) -> str | None:
    """Ferry names the worker in a header; Dynamo in `nvext.worker_id` when asked with `extra_fields`."""
    header = resp.headers.get("x-ferry-worker")
    if header:
        return header
    for _at, data in resp.events:
        i = data.find(_DYNAMO_WORKER)
        if i >= 0:
            j = i + len(_DYNAMO_WORKER)
            end = j
            while end < len(data) and data[end : end + 1].isdigit():
                end += 1
            return data[j:end].decode() or None
    return None


def _cached_tokens(resp: Response) -> int:
    for _at, data in reversed(resp.events):
        if b'"usage"' in data and data != b"[DONE]":
            try:
                chunk = _usage_decoder.decode(data)
            except msgspec.DecodeError:
                continue
            if chunk.usage is not None:
                d = chunk.usage.prompt_tokens_details
                return (d.cached_tokens or 0) if d is not None else 0
    return 0


async def replay(
    host: str,
    port: int,
    model: str,
    items: list[WorkItem],
    *,
    request_timeout_s: float = 120.0,
    deadline_s: float = 300.0,
    max_inflight: int = 1024,
    extra_body: dict[str, Any] | None = None,
) -> ReplayResult:
    """Send every item at its arrival time; stop sending at `deadline_s` and abandon what is still running
    then (counted as failed with error "deadline")."""
    idle: list[Connection] = []
    results: dict[int, RequestResult] = {}
    bodies = [request_body(model, it, extra_body) for it in items]
    loop = asyncio.get_running_loop()
    start = time.perf_counter() + 0.05
    inflight = 0
    not_sent = 0

    async def one(i: int, item: WorkItem) -> None:
        nonlocal inflight
        conn = idle.pop() if idle else Connection(host, port)
        sent = time.perf_counter()
        res = RequestResult(item.index, item.at, sent - start - item.at, ok=False)
        results[item.index] = res
        try:
            resp = await conn.post_json("/v1/completions", bodies[i], timeout_s=request_timeout_s)
        except asyncio.CancelledError:
            conn.close()
            res.error = "deadline"
            # Cut off by the run's deadline: its first token may still have come (a TTFT to count).
            if conn.partial is not None and conn.partial.status == 200:
                res.ttft = stream_stats(conn.partial).ttft
                res.worker = _worker(conn.partial)
            raise
        except Exception as exc:
            conn.close()
            res.error = f"{type(exc).__name__}: {exc}"[:200]
            return
        finally:
            inflight -= 1
        idle.append(conn)
        st = stream_stats(resp)
        res.ok, res.status, res.error = st.ok, st.status, st.error
        res.ttft, res.itls, res.e2e = st.ttft, st.itls, st.duration
        res.finished_at = resp.finished - start
        res.prompt_tokens, res.completion_tokens = st.prompt_tokens, st.completion_tokens
        res.cached_tokens = _cached_tokens(resp) if st.ok else 0
        res.worker = _worker(resp) if st.ok else None

    tasks: list[asyncio.Task[None]] = []
    for i, item in enumerate(items):
        delay = start + item.at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if time.perf_counter() - start > deadline_s:
            not_sent += len(items) - i
            break
        if inflight >= max_inflight:
            not_sent += 1
            continue
        inflight += 1
        tasks.append(loop.create_task(one(i, item)))
    if tasks:
        remaining = max(0.0, deadline_s - (time.perf_counter() - start))
        _done, pending = await asyncio.wait(tasks, timeout=remaining)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
    for conn in idle:
        conn.close()
    ends = [r.finished_at for r in results.values() if not math.isnan(r.finished_at)]
    wall = max(ends) if ends else time.perf_counter() - start
    return ReplayResult(sorted(results.values(), key=lambda r: r.index), wall, not_sent)


async def closed_loop(
    host: str,
    port: int,
    model: str,
    items: list[WorkItem],
    *,
    concurrency: int,
    request_timeout_s: float = 120.0,
    extra_body: dict[str, Any] | None = None,
) -> ReplayResult:
    """Send the items in order, `concurrency` at a time, each as soon as a previous one has finished: the
    unloaded reference (with `concurrency` = the number of workers, each worker has about one request)."""
    queue = list(reversed(items))
    results: list[ReplayResult] = []
    start = time.perf_counter()

    async def lane() -> None:
        while queue:
            item = queue.pop()
            at = time.perf_counter() - start
            rep = await replay(
                host, port, model, [replace(item, at=0.0)], request_timeout_s=request_timeout_s,
                deadline_s=request_timeout_s + 5, extra_body=extra_body,
            )  # fmt: skip
            for r in rep.results:
                r.scheduled, r.lateness = at, 0.0
                r.finished_at += at
            results.append(rep)

    await asyncio.gather(*(lane() for _ in range(concurrency)))
    flat = sorted((r for rep in results for r in rep.results), key=lambda r: r.index)
    return ReplayResult(flat, time.perf_counter() - start, sum(rep.not_sent for rep in results))
