"""Prometheus metrics of a worker process, and the /metrics server that exposes them.

Every family is kept unlabelled by model and worker in `registry` (nothing to look up on the hot path);
the exposition adds `model` and `worker` to every sample at scrape time. With the vLLM engine, vLLM's own
`vllm:*` families (its Prometheus stat logger, in this process's default registry or, under
PROMETHEUS_MULTIPROC_DIR, its multiprocess files) are served beside them, so vLLM dashboards read workers too.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from bus.lag_gauge import ConsumerLag
from bus.reader import Reader
from kvstore.registry import reachable_host
from workers.engine import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Labelled(Collector):
    """Another registry's families with constant labels added to every sample."""

    def __init__(self, source: CollectorRegistry, labels: dict[str, str]) -> None:
        self._source = source
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        """Every family of the source, relabelled."""
        for family in self._source.collect():
            family.samples = [
                Sample(s.name, {**self._labels, **s.labels}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
            yield family


class _Process(Collector):
    """This process's default registry: vLLM's families and the process/GC collectors."""

    def collect(self) -> Iterable[Metric]:
        """The default registry's families, or the multiprocess files when vLLM writes those."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return MultiProcessCollector(None).collect()
        return REGISTRY.collect()


class WorkerMetrics:
    """The worker's metric families, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._server: WSGIServer | None = None
        r = self.registry
        self.requests = Counter("ferry_worker_requests", "Requests by outcome", ["outcome"], registry=r)
        self.generated_tokens = Counter("ferry_worker_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("ferry_worker_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            "ferry_worker_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        # vLLM's names and meaning (vllm:prefix_cache_queries / _hits), counted per sequence once scheduled.
        self.prefix_queries = Counter(
            "ferry_worker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter(
            "ferry_worker_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r
        )
        self.queue_seconds = Histogram(
            "ferry_worker_queue_seconds", "Per sequence: time in the engine's queue before first scheduled",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill_seconds = Histogram(
            "ferry_worker_prefill_seconds", "Per sequence: first scheduled to first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode_seconds = Histogram(
            "ferry_worker_decode_seconds", "Per sequence: first token to last token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.running = Gauge("ferry_worker_engine_running", "Sequences the engine is running", registry=r)
        self.waiting = Gauge("ferry_worker_engine_waiting", "Sequences waiting in the engine", registry=r)
        self.kv_usage = Gauge("ferry_worker_kv_usage", "Fraction of KV blocks in use", registry=r)
        self.inflight = Gauge("ferry_worker_inflight", "Requests being served", registry=r)
        self.kafka_lag = ConsumerLag(r)
        self.kafka_send_errors = Counter(
            "ferry_worker_kafka_send_errors", "Reply chunks Kafka failed to take", registry=r
        )
        self.kv_events = Counter("ferry_worker_kv_events", "KV events written to the index", registry=r)
        # 1 while the inbox's doorbell subscription stands (it sleeps while idle), 0 while it polls every
        # --kafka-fetch-wait-ms (--no-doorbell, or Redis pub/sub away): set by the worker.
        self.inbox_doorbell = Gauge(
            "ferry_worker_inbox_doorbell", "1 while the requests inbox sleeps when idle, woken by rings", registry=r
        )
        self.kv_publish_errors = Counter(
            "ferry_worker_kv_publish_errors", "KV event writes Redis did not take", registry=r
        )
        self.kv_log_records = Counter(
            "ferry_worker_kv_log_records", "Records written to the KV log, by kind", ["kind"], registry=r
        )
        self.kv_log_errors = Counter(
            "ferry_worker_kv_log_errors", "KV log writes Kafka did not take", registry=r
        )
        self.kv_index_resets = Counter(
            "ferry_worker_kv_index_resets",
            "Times the backlog overflowed and the index was rebuilt",
            registry=r,
        )
        self.heartbeat_errors = Counter(
            "ferry_worker_heartbeat_errors", "Heartbeats Redis did not take", registry=r
        )

    def observe(self, stats: EngineStats, inflight: int) -> None:
        """Record one engine stats snapshot."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.inflight.set(inflight)

    async def record_lag(self, reader: Reader[Any]) -> None:
        """Set the consumer lag of `reader`'s topics."""
        await self.kafka_lag.record(reader)

    def exposition(self, model: str, worker: str, role: str = "both") -> CollectorRegistry:
        """What /metrics serves: these families labelled with `model`, `worker` and `worker_role` (prefill,
        decode or both: a disaggregated fleet's pools apart), and the process's own."""
        out = CollectorRegistry(auto_describe=False)
        out.register(_Labelled(self.registry, {"model": model, "worker": worker, "worker_role": role}))
        out.register(_Process())
        return out

    def serve(self, host: str, port: int, model: str, worker: str, role: str = "both") -> str:
        """Serve /metrics in a background thread; return the URL others reach it at (for the registry)."""
        server, _thread = start_http_server(port, addr=host, registry=self.exposition(model, worker, role))
        self._server = server
        return f"http://{reachable_host(host)}:{server.server_port}/metrics"

    async def close(self) -> None:
        """Stop the /metrics server and free its port (a worker inside a longer-lived process must not leak it)."""
        server, self._server = self._server, None
        if server is not None:
            await asyncio.to_thread(server.shutdown)  # waits out serve_forever's poll (≤ 0.5 s)
            server.server_close()
