"""Statistics, load generation, the Kafka floor and the frontend's own metrics of `bench.overhead`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.sse_client import Connection, Response, StreamStats, stream_stats
from bench.stack import CpuUsage, FerryStack
from bench.stats import pct

TARGET_TTFT_P50_MS = 5.0  # added time to first token at concurrency 1 (issue 2, item 8)
TARGET_TOKENS_PER_S = 5000.0  # streamed tokens/s through one frontend at concurrency 64
TARGET_TPS_CONCURRENCY = 64
INTERFERENCE_CONCURRENCY = 16
REQUEST_TIMEOUT_S = 60.0

_WORDS = (
    "ferry harbour tide rope deck cargo engine captain island bridge wave north south lantern anchor "
    "gull signal crossing timetable passenger ticket vehicle ramp storm calm morning evening river"
).split()


# ---- statistics ----------------------------------------------------------------------------------


def ms(seconds: float) -> float | None:
    """Seconds to milliseconds rounded for reports; None (JSON null) for NaN."""
    return None if math.isnan(seconds) else round(seconds * 1000.0, 3)


@dataclass
class PhaseResult:
    """One measured phase: many streamed requests at a fixed concurrency."""

    name: str
    concurrency: int
    stats: list[StreamStats]
    wall_s: float
    cpu: CpuUsage | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> list[StreamStats]:
        """Requests that streamed to the end with usage."""
        return [s for s in self.stats if s.ok]

    @property
    def tokens(self) -> int:
        """Completion tokens of the successful requests."""
        return sum(s.completion_tokens for s in self.ok)

    @property
    def tokens_per_s(self) -> float:
        """Streamed tokens per second of wall time."""
        return self.tokens / self.wall_s if self.wall_s > 0 else math.nan

    def ttft(self, q: float) -> float:
        """Percentile of time to first token, seconds."""
        return pct((s.ttft for s in self.ok), q)

    def ttfb(self, q: float) -> float:
        """Percentile of time to the first SSE event (the role chunk), seconds."""
        return pct((s.ttfb for s in self.ok), q)

    def itl(self, q: float) -> float:
        """Percentile of the gaps between text-carrying events, pooled over all requests, seconds."""
        return pct((x for s in self.ok for x in s.itls), q)

    def summary(self, max_tokens: int) -> dict[str, Any]:
        """The phase as a JSON-ready dict."""
        ok = self.ok
        errors = Counter(s.error or f"HTTP {s.status}" for s in self.stats if not s.ok)
        short = sum(1 for s in ok if s.completion_tokens != max_tokens)
        events = [s.content_events for s in ok]
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "requests": len(self.stats),
            "ok": len(ok),
            "failed": len(self.stats) - len(ok),
            "errors": dict(errors.most_common(5)),
            "completion_tokens_not_max_tokens": short,
            "wall_s": round(self.wall_s, 3),
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens_per_s, 1),
            "requests_per_s": round(len(ok) / self.wall_s, 2) if self.wall_s > 0 else None,
            "ttfb_ms": {"p50": ms(self.ttfb(50)), "p99": ms(self.ttfb(99))},
            "ttft_ms": {"p50": ms(self.ttft(50)), "p90": ms(self.ttft(90)), "p99": ms(self.ttft(99))},
            "itl_ms": {"p50": ms(self.itl(50)), "p90": ms(self.itl(90)), "p99": ms(self.itl(99))},
            "itl_samples": sum(len(s.itls) for s in ok),
            "content_events_per_request": round(float(np.mean(events)), 2) if events else None,
            "tokens_per_content_event": round(self.tokens / sum(events), 2) if sum(events) else None,
            "e2e_ms": {
                "p50": ms(pct((s.duration for s in ok), 50)),
                "p99": ms(pct((s.duration for s in ok), 99)),
            },
            "cpu": self.cpu.to_json() if self.cpu else None,
            **self.extra,
        }


# ---- load generation -----------------------------------------------------------------------------


def prompt_text(i: int, words: int) -> str:
    """A prompt of `words` words; 0 gives the short one-line question. Request `i` gets its own words, so no
    two prompts share a prefix beyond the chat template."""
    if words <= 0:
        return f"Tell me about ferry crossing number {i}."
    rng = random.Random(i)
    return " ".join([f"crossing{i}", *(rng.choice(_WORDS) for _ in range(words - 1))])


def chat_body(model: str, max_tokens: int, i: int, prompt_words: int = 0) -> bytes:
    """A streamed chat request that generates exactly `max_tokens` tokens (`prompt_text` is its prompt)."""
    return msgspec.json.encode(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt_text(i, prompt_words)}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    )


async def run_streams(
    host: str,
    port: int,
    concurrency: int,
    max_requests: int,
    seconds: float,
    body: Callable[[int], bytes],
) -> tuple[list[StreamStats], float]:
    """`concurrency` users, each streaming one request after another on its own keep-alive connection.

    New requests stop once `max_requests` were issued or `seconds` passed; requests in flight then finish.
    Returns the per-request stats and the wall time from the first request to the last response.
    """
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = t0 + seconds
    issued = 0
    stats: list[StreamStats] = []
    last_end = t0

    async def user() -> None:
        nonlocal issued, last_end
        conn = Connection(host, port)
        try:
            while issued < max_requests and loop.time() < deadline:
                issued += 1
                payload = body(issued)
                started = time.perf_counter()
                try:
                    resp = await conn.post_json("/v1/chat/completions", payload, REQUEST_TIMEOUT_S)
                    stats.append(stream_stats(resp))
                except (OSError, TimeoutError) as exc:
                    nan = math.nan
                    elapsed = time.perf_counter() - started
                    stats.append(StreamStats(0, False, nan, nan, [], elapsed, 0, 0, 0, repr(exc)))
                last_end = loop.time()
        finally:
            conn.close()

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return stats, last_end - t0


def long_prompts(chars: int, variants: int, seed: int = 7) -> list[str]:
    """Distinct prose-like prompts of about `chars` characters each."""
    rng = random.Random(seed)
    out = []
    for v in range(variants):
        words: list[str] = [f"variant{v}"]
        size = 0
        while size < chars:
            w = rng.choice(_WORDS)
            words.append(w)
            size += len(w) + 1
        out.append(" ".join(words)[:chars])
    return out


async def long_prompt_load(
    host: str, port: int, model: str, prompts: list[str], clients: int, stop: asyncio.Event
) -> list[tuple[int, float]]:
    """Keep sending non-streamed /v1/completions with huge prompts (max_tokens 1) until `stop` is set."""
    bodies = [msgspec.json.encode({"model": model, "prompt": p, "max_tokens": 1}) for p in prompts]
    results: list[tuple[int, float]] = []

    async def client(k: int) -> None:
        conn = Connection(host, port)
        i = k
        try:
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    resp = await conn.post_json("/v1/completions", bodies[i % len(bodies)], REQUEST_TIMEOUT_S)
                    results.append((resp.status, resp.finished - resp.started))
                except (OSError, TimeoutError):
                    results.append((0, time.perf_counter() - t))
                i += clients
        finally:
            conn.close()

    await asyncio.gather(*(client(k) for k in range(clients)))
    return results


# ---- the Kafka floor -----------------------------------------------------------------------------


async def kafka_floor(bootstrap: str, n: int, fetch_wait_ms: int, payload_bytes: int = 200) -> dict[str, Any]:
    """Produce -> consume round trips of one small record at a time through `bootstrap`.

    Producer and consumer are configured as the frontend's and workers' are (linger 0, the same fetch
    wait), so this is the least one Kafka hop of a request can cost. Two series: back to back (the consumer
    has just re-issued its fetch, as on a busy reply topic) and after 10 ms of quiet (the consumer is parked
    in a long poll, as an idle worker's inbox is when a request arrives). Also times produce -> ack.
    """
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = f"ferry.bench.floor.{secrets.token_hex(4)}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=fetch_wait_ms
    )
    await producer.start()
    await consumer.start()
    pad = b"x" * max(0, payload_bytes - 8)
    seq = 0

    async def round_trips(count: int, gap_s: float) -> list[float]:
        nonlocal seq
        out = []
        for _ in range(count):
            if gap_s:
                await asyncio.sleep(gap_s)
            seq += 1
            value = seq.to_bytes(8, "little") + pad
            t0 = time.perf_counter()
            await producer.send(topic, value, key=b"k")
            while (await consumer.getone()).value != value:
                pass
            out.append(time.perf_counter() - t0)
        return out

    def dist(xs: list[float]) -> dict[str, Any]:
        d: dict[str, Any] = {f"p{q}": ms(pct(xs, q)) for q in (50, 90, 99)}
        d["share_over_10ms"] = round(sum(1 for x in xs if x > 0.010) / len(xs), 3) if xs else None
        return d

    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        await consumer.position(tp)
        await round_trips(20, 0.0)  # warm-up
        hot = await round_trips(n, 0.0)
        idle = await round_trips(n, 0.010)
        ack = []
        for i in range(n):
            t0 = time.perf_counter()
            await producer.send_and_wait(topic, b"a" * payload_bytes, key=str(i).encode())
            ack.append(time.perf_counter() - t0)
    finally:
        await consumer.stop()
        await producer.stop()
    return {
        "fetch_max_wait_ms": fetch_wait_ms,
        "round_trips_per_series": n,
        "payload_bytes": payload_bytes,
        "produce_consume_ms": dist(hot),
        "produce_consume_after_idle_ms": dist(idle),
        "produce_ack_ms": {f"p{q}": ms(pct(ack, q)) for q in (50, 99)},
    }


_SERVER_HISTOGRAMS = {
    "ttft": "ferry_time_to_first_token_seconds",
    "kafka_produce": "ferry_kafka_produce_seconds",
    "tokenize": "ferry_tokenize_seconds",
    "route": "ferry_router_decision_seconds",
    "worker_queue": "ferry_request_queue_seconds",
    "worker_prefill": "ferry_request_prefill_seconds",
}


async def scrape_metrics(stack: FerryStack) -> dict[str, float]:
    """`_sum` and `_count` samples of the frontend's Prometheus metrics, summed over their labels (such as
    `model`); empty if unavailable."""
    conn = Connection(stack.host, stack.port)
    try:
        resp = await conn.request("GET", "/metrics", timeout_s=10)
    except (OSError, TimeoutError):
        return {}
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in resp.body.decode(errors="replace").splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        name = sample.split("{", 1)[0]
        if name.endswith(("_sum", "_count")):
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(value)
    return out


def server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean of each frontend histogram over the samples taken between two scrapes, in ms."""
    means: dict[str, float | None] = {}
    for key, metric in _SERVER_HISTOGRAMS.items():
        n = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        total = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
        means[key] = round(1000.0 * total / n, 3) if n > 0 else None
    return means


async def served_model(stack: FerryStack) -> tuple[str, str | None]:
    """Name and directory of the model the frontend serves."""
    conn = Connection(stack.host, stack.port)
    try:
        resp: Response = await conn.request("GET", "/v1/models", timeout_s=10)
    finally:
        conn.close()
    card = json.loads(resp.body)["data"][0]
    return card["id"], card.get("root")


def tokenize_ms(model_dir: str | None, text: str) -> float:
    """Wall time of tokenizing `text` once with the model's tokenizer, in this process."""
    if not model_dir:
        return math.nan
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    tok.encode("warm up")
    t = time.perf_counter()
    tok.encode(text)
    return (time.perf_counter() - t) * 1000.0


async def topic_records(bootstrap: str, topic: str) -> int | None:
    """How many records partition 0 of `topic` holds (its end offset)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        await consumer.start()
        tp = TopicPartition(topic, 0)
        return int((await consumer.end_offsets([tp]))[tp])
    except Exception:
        return None
    finally:
        await consumer.stop()
