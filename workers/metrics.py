"""Prometheus metrics of a worker process, recorded from engine stats once per heartbeat."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from workers.engine import EngineStats


class WorkerMetrics:
    """The worker's metric families, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ferry_worker_requests", "Requests by outcome", ["outcome"], registry=r)
        self.generated_tokens = Counter("ferry_worker_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("ferry_worker_prompt_tokens", "Prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            "ferry_worker_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.running = Gauge("ferry_worker_engine_running", "Sequences the engine is running", registry=r)
        self.waiting = Gauge("ferry_worker_engine_waiting", "Sequences waiting in the engine", registry=r)
        self.kv_usage = Gauge("ferry_worker_kv_usage", "Fraction of KV blocks in use", registry=r)
        self.prefix_hit_rate = Gauge(
            "ferry_worker_prefix_hit_rate", "Cached prompt tokens / prompt tokens", registry=r
        )
        self.inflight = Gauge("ferry_worker_inflight", "Requests being served", registry=r)
        self.kafka_send_errors = Counter(
            "ferry_worker_kafka_send_errors", "Reply chunks Kafka failed to take", registry=r
        )
        self.kv_events = Counter("ferry_worker_kv_events", "KV events written to the index", registry=r)
        self.kv_publish_errors = Counter(
            "ferry_worker_kv_publish_errors", "KV event writes Redis did not take", registry=r
        )
        self.kv_index_resets = Counter(
            "ferry_worker_kv_index_resets", "Times the backlog overflowed and the index was rebuilt", registry=r
        )
        self.heartbeat_errors = Counter(
            "ferry_worker_heartbeat_errors", "Heartbeats Redis did not take", registry=r
        )

    def observe(self, stats: EngineStats, inflight: int) -> None:
        """Record one engine stats snapshot."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage)
        self.prefix_hit_rate.set(stats.prefix_hit_rate)
        self.inflight.set(inflight)

    def serve(self, host: str, port: int) -> str:
        """Serve /metrics in a background thread; return its URL."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return f"http://{host}:{server.server_port}/metrics"
