"""Batch-work metrics of a worker's pool consumer (workers/pool_consumer.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class PoolMetrics:
    """Batch-work metrics, in the worker's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.items = Counter(
            "ferry_worker_pool_items",
            "Batch items taken from the pool by outcome",
            ["outcome"],
            registry=registry,
        )
        self.inflight = Gauge("ferry_worker_pool_inflight", "Batch sequences running", registry=registry)
        self.paused = Gauge(
            "ferry_worker_pool_paused", "1 while the pool is paused for lack of room", registry=registry
        )
        self.commits = Counter(
            "ferry_worker_pool_commits", "Offset commits of pool partitions", registry=registry
        )
