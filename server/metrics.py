"""Prometheus metrics of a frontend process.

Per-token observations are the hot path: a request binds its model's labelled children once
(`for_model`) and observes on them, never looking labels up per token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bus.lag_gauge import ConsumerLag
from bus.reader import Reader

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def observe_times(child: Histogram, value: float, n: int) -> None:
    """`n` observations of `value` at the cost of one: a delivery of k tokens observes k inter-token gaps.

    prometheus_client has no weighted observe; this does what `observe` does (the first bucket whose bound
    is >= the value, and the sum) with counts of `n`. tests/unit/test_metrics_observe.py holds it to
    `observe` called `n` times.
    """
    child._raise_if_not_observable()  # type: ignore[attr-defined]
    child._sum.inc(value * n)  # type: ignore[attr-defined]
    child._buckets[bisect.bisect_left(child._upper_bounds, value)].inc(n)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class ModelMetrics:
    """The children of one model's request metrics, bound once and shared by its requests."""

    ttft: Histogram
    itl: Histogram
    e2e: Histogram
    queue: Histogram
    prefill: Histogram
    decode: Histogram
    prompt_len: Histogram
    completion_len: Histogram


class FrontendMetrics:
    """The frontend's metric families, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._models: dict[str, ModelMetrics] = {}
        self.requests = Counter(
            "ferry_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.errors = Counter(
            "ferry_request_errors",
            "Failed requests by model and error type; stage=request before the response started, stream inside it",
            ["model", "type", "stage"],
            registry=r,
        )
        self.inflight = Gauge("ferry_requests_inflight", "Client requests in progress", registry=r)
        self.ttft = Histogram(
            "ferry_time_to_first_token_seconds", "Request arrival to first token", ["model"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "ferry_inter_token_latency_seconds",
            "Time between tokens, one observation per token after the first (a delivery of k tokens after a "
            "gap g counts k times g/k)",
            ["model"], buckets=_ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "ferry_request_duration_seconds",
            "Request arrival to the end of its response (the last SSE event of a stream); successful requests",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "ferry_request_queue_seconds",
            "Per sequence: waiting in the frontend for a worker plus waiting in the engine's queue",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prefill = Histogram(
            "ferry_request_prefill_seconds", "Per sequence: engine scheduling to first token (worker-measured)",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decode = Histogram(
            "ferry_request_decode_seconds", "Per sequence: first token to last token (worker-measured)",
            ["model"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_len = Histogram(
            "ferry_request_prompt_tokens", "Per sequence: prompt length in tokens", ["model"],
            buckets=_LENGTH_BUCKETS, registry=r,
        )  # fmt: skip
        self.completion_len = Histogram(
            "ferry_request_completion_tokens", "Per sequence: completion length in tokens", ["model"],
            buckets=_LENGTH_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("ferry_prompt_tokens", "Prompt tokens", registry=r)
        self.completion_tokens = Counter("ferry_completion_tokens", "Completion tokens", registry=r)
        self.cached_tokens = Counter(
            "ferry_cached_prompt_tokens", "Prompt tokens the workers reported as cached", registry=r
        )
        self.migrations = Counter(
            "ferry_migrations",
            "Sequence moves to another worker: reason (worker_died, engine_died, worker_stopped, log_lost, chunk_lost, "
            "request_lost; handoff: "
            "a disaggregated sequence's move from its prefill to its decode worker) and "
            "outcome (moved: the new attempt was sent; failed: the sequence ended with an error instead)",
            ["reason", "outcome"],
            registry=r,
        )
        self.router_decisions = Counter(
            "ferry_router_decisions",
            "Sequences routed, by policy and worker",
            ["policy", "worker"],
            registry=r,
        )
        self.kafka_produce_seconds = Histogram(
            "ferry_kafka_produce_seconds",
            "Produce-to-ack latency of requests",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.kafka_errors = Counter("ferry_kafka_errors", "Produces that failed", registry=r)
        self.kafka_lag = ConsumerLag(r)
        self.redis_seconds = Histogram(
            "ferry_redis_seconds", "Redis round trips", ["op"], buckets=_FAST_BUCKETS, registry=r
        )
        self.redis_errors = Counter("ferry_redis_errors", "Redis operations that failed", registry=r)
        self.redis_up = Gauge("ferry_redis_up", "1 while Redis answers", registry=r)
        self.redis_up.set(1)
        self.live_workers = Gauge("ferry_live_workers", "Workers in the registry", registry=r)
        # Set by the frontend from its replies reader's bell (server/reply_bell.py).
        self.replies_doorbell = Gauge(
            "ferry_replies_doorbell",
            "1 while workers can ring the replies reader, which then sleeps between a stream's records",
            registry=r,
        )
        self.queue_depth = Gauge(
            "ferry_router_queue_depth",
            "Requests waiting in the frontend because every worker is busy",
            registry=r,
        )
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
            "ferry_router_predicted_cached_tokens",
            "Prompt tokens the router expected to be cached",
            registry=r,
        )
        self.kv_index_up = Gauge("ferry_router_kv_index_up", "1 while the KV index answers", registry=r)
        self.kv_index_up.set(1)
        self.busy_waits = Counter(
            "ferry_router_busy_waits",
            "Requests that waited because every worker was busy",
            ["outcome"],
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "ferry_tokenize_seconds", "Chat templating and tokenization", buckets=_FAST_BUCKETS, registry=r
        )

        # Per tenant: tenant names come from the tenants file, so these label sets are bounded.
        self.tenant_requests = Counter(
            "ferry_tenant_requests", "Generation requests of a tenant that were admitted, by outcome (ok, error)",
            ["tenant", "outcome"], registry=r,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "ferry_tenant_tokens", "Tokens of a tenant's admitted requests, by kind (prompt, completion)",
            ["tenant", "kind"], registry=r,
        )  # fmt: skip
        self.tenant_rejections = Counter(
            "ferry_tenant_rejections",
            "A tenant's requests refused by its quota: reason requests, tokens, concurrency (429) or redis (503)",
            ["tenant", "reason"], registry=r,
        )  # fmt: skip
        self.tenant_inflight = Gauge(
            "ferry_tenant_inflight", "A tenant's admitted requests in progress on this frontend", ["tenant"],
            registry=r,
        )  # fmt: skip
        self.tenant_queued = Gauge(
            "ferry_tenant_queued", "A tenant's requests waiting for their weighted-fair turn on this frontend",
            ["tenant"], registry=r,
        )  # fmt: skip
        self.tenant_quota_unchecked = Counter(
            "ferry_tenant_quota_unchecked", "A tenant's requests admitted without a quota check (Redis down)",
            ["tenant"], registry=r,
        )  # fmt: skip

    def for_model(self, model: str) -> ModelMetrics:
        """The request metrics of `model`, bound once per model."""
        m = self._models.get(model)
        if m is None:
            m = self._models[model] = ModelMetrics(
                ttft=self.ttft.labels(model), itl=self.itl.labels(model), e2e=self.e2e.labels(model),
                queue=self.queue.labels(model), prefill=self.prefill.labels(model),
                decode=self.decode.labels(model), prompt_len=self.prompt_len.labels(model),
                completion_len=self.completion_len.labels(model),
            )  # fmt: skip
        return m

    async def record_lag(self, reader: Reader[Any]) -> None:
        """Set the consumer lag of `reader`'s topics."""
        await self.kafka_lag.record(reader)
