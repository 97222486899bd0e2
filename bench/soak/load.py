"""The soak's client: the requests, the system they go to, and the closed- or open-loop load that issues them."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from bench.soak.report import Outcome
from bench.sse_client import Connection, stream_stats

REQUEST_TIMEOUT_S = 120.0
_WORDS = (
    "ferry harbour tide rope deck cargo engine captain island bridge wave north south lantern anchor "
    "gull signal crossing timetable passenger ticket vehicle ramp storm calm morning evening river"
).split()


def make_body(model: str, words: int, max_tokens: int) -> Callable[[int], bytes]:
    """Request `i`: a streamed chat of about `words` words, distinct per request, generating `max_tokens`."""
    rng = random.Random(11)
    text = " ".join(rng.choice(_WORDS) for _ in range(max(1, words - 2)))

    def body(i: int) -> bytes:
        return msgspec.json.encode({
            "model": model,
            "messages": [{"role": "user", "content": f"Request {i}: {text}"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "ignore_eos": True,
        })  # fmt: skip

    return body


@dataclass
class Target:
    """One system under load: where it serves, the process whose exit ends the load, its processes by role."""

    name: str  # "ferry" or "vllm-server"
    host: str
    port: int
    proc: asyncio.subprocess.Process
    pids: dict[str, int]


@dataclass(frozen=True)
class Plan:
    """The soak's load: `concurrency` streams back to back, or open-loop arrivals at `rate` per second."""

    concurrency: int | None
    rate: float | None
    desc: str


class Load:
    """Requests against one system, bounded by a deadline and a count; every outcome kept."""

    def __init__(self, target: Target, body: Callable[[int], bytes], t0: float, max_requests: int) -> None:
        self.target = target
        self.body = body
        self.t0 = t0
        self.max_requests = max_requests
        self.issued = 0
        self.outcomes: list[Outcome] = []
        self.shed = 0  # open loop: arrivals dropped because the in-flight cap was reached
        self.stack_exited_at: float | None = None
        self._idle: list[Connection] = []

    async def watch_stack(self) -> None:
        """Stop issuing requests once the system has exited (a dead one would fail every request at once)."""
        await self.target.proc.wait()
        self.stack_exited_at = time.perf_counter() - self.t0

    def _connect(self) -> Connection:
        return Connection(self.target.host, self.target.port)

    async def one(self, conn: Connection) -> None:
        """Issue one request on `conn` and record it."""
        self.issued += 1
        i = self.issued
        started = time.perf_counter()
        try:
            resp = await conn.post_json("/v1/chat/completions", self.body(i), REQUEST_TIMEOUT_S)
            st = stream_stats(resp)
            o = Outcome(
                started - self.t0, resp.finished - self.t0, st.ttft, st.ok, st.completion_tokens, st.error
            )
        except (OSError, TimeoutError) as exc:
            o = Outcome(started - self.t0, time.perf_counter() - self.t0, math.nan, False, 0, repr(exc))
            await asyncio.sleep(0.5)  # the server is unreachable: do not spin
        self.outcomes.append(o)

    def _more(self, deadline: float) -> bool:
        return (
            self.issued < self.max_requests
            and time.perf_counter() < deadline
            and self.stack_exited_at is None
        )

    async def closed(self, concurrency: int, deadline: float) -> None:
        """`concurrency` users, each streaming one request after another on its own connection."""

        async def user() -> None:
            conn = self._connect()
            try:
                while self._more(deadline):
                    await self.one(conn)
            finally:
                conn.close()

        await asyncio.gather(*(user() for _ in range(concurrency)))

    async def open(self, rate: float, cap: int, deadline: float) -> None:
        """Poisson arrivals at `rate` per second, at most `cap` in flight (beyond it, arrivals are shed)."""
        rng = random.Random(5)
        tasks: set[asyncio.Task[None]] = set()
        next_at = time.perf_counter()
        while self._more(deadline):
            next_at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            if len(tasks) >= cap:
                self.shed += 1
                continue
            conn = self._idle.pop() if self._idle else self._connect()
            task = asyncio.ensure_future(self._pooled(conn))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        for conn in self._idle:
            conn.close()

    async def _pooled(self, conn: Connection) -> None:
        try:
            await self.one(conn)
        finally:
            self._idle.append(conn)


async def probe(
    target: Target, body: Callable[[int], bytes], concurrency: int, seconds: float
) -> dict[str, Any]:
    """Capacity: requests/s and tokens/s at `concurrency` streams back to back for `seconds`."""
    t0 = time.perf_counter()
    load = Load(target, body, t0, 10**9)
    await load.closed(concurrency, t0 + seconds)
    wall = time.perf_counter() - t0
    ok = [o for o in load.outcomes if o.ok]
    return {"concurrency": concurrency, "seconds": round(wall, 2), "requests": len(load.outcomes), "ok": len(ok),
            "requests_per_s": round(len(ok) / wall, 2), "tokens_per_s": round(sum(o.tokens for o in ok) / wall, 1)}  # fmt: skip


async def served_model(target: Target) -> str:
    """The name of the model the system serves."""
    conn = Connection(target.host, target.port)
    try:
        resp = await conn.request("GET", "/v1/models", timeout_s=10)
    finally:
        conn.close()
    return str(json.loads(resp.body)["data"][0]["id"])
