"""Prometheus metrics of a frontend process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)


class FrontendMetrics:
    """The frontend's metric families, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ferry_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.inflight = Gauge("ferry_requests_inflight", "Client requests in progress", registry=r)
        self.ttft = Histogram(
            "ferry_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ferry_inter_token_latency_seconds", "Time between streamed deltas", buckets=_FAST_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "ferry_request_duration_seconds", "Whole request duration", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("ferry_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("ferry_completion_tokens", "Completion tokens", registry=r)
        self.cached_tokens = Counter(
            "ferry_cached_prompt_tokens", "Prompt tokens the workers reported as cached", registry=r
        )
        self.router_decisions = Counter(
            "ferry_router_decisions", "Sequences routed, by policy and worker", ["policy", "worker"], registry=r
        )
        self.kafka_produce_seconds = Histogram(
            "ferry_kafka_produce_seconds", "Produce-to-ack latency of requests", buckets=_FAST_BUCKETS, registry=r
        )
        self.kafka_errors = Counter("ferry_kafka_errors", "Produces that failed", registry=r)
        self.redis_seconds = Histogram(
            "ferry_redis_seconds", "Redis round trips", ["op"], buckets=_FAST_BUCKETS, registry=r
        )
        self.redis_errors = Counter("ferry_redis_errors", "Redis operations that failed", registry=r)
        self.redis_up = Gauge("ferry_redis_up", "1 while Redis answers", registry=r)
        self.redis_up.set(1)
        self.live_workers = Gauge("ferry_live_workers", "Workers in the registry", registry=r)
        self.reply_topic_rolls = Counter(
            "ferry_reply_topic_rolls", "Times the frontend started a fresh replies topic", registry=r
        )
        self.worker_failures = Counter(
            "ferry_worker_failures", "Sequences ended because their worker died", registry=r
        )
        self.reply_gaps = Counter(
            "ferry_reply_gaps",
            "Sequences moved because a reply chunk never reached the replies topic",
            registry=r,
        )
        self.requests_lost = Counter(
            "ferry_requests_lost",
            "Requests sent again because the broker no longer held them (restarted empty) when no answer came",
            registry=r,
        )
        self.router_decision_seconds = Histogram(
            "ferry_router_decision_seconds", "Time to choose a worker", buckets=_FAST_BUCKETS, registry=r
        )
        self.predicted_cached_tokens = Counter(
            "ferry_router_predicted_cached_tokens", "Prompt tokens the router expected to be cached", registry=r
        )
        self.kv_index_up = Gauge("ferry_router_kv_index_up", "1 while the KV index answers", registry=r)
        self.kv_index_up.set(1)
        self.busy_waits = Counter(
            "ferry_router_busy_waits", "Requests that waited because every worker was busy", ["outcome"],
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "ferry_tokenize_seconds", "Chat templating and tokenization", buckets=_FAST_BUCKETS, registry=r
        )
