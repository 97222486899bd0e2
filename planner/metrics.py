"""Prometheus metrics of the planner: its decisions, the count it wants and what it based that on."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class PlannerMetrics:
    """The planner's metric families, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        # KEDA's Prometheus trigger and the dashboard read these two names as they are.
        self.desired = Gauge("ferry_planner_desired_workers", "Workers the planner wants", registry=r)
        self.decisions = Counter(
            "ferry_planner_decisions",
            "Planner decisions by action and reason",
            ["action", "reason"],
            registry=r,
        )
        self.ready = Gauge("ferry_planner_ready_workers", "Workers registered and not draining", registry=r)
        self.starting = Gauge(
            "ferry_planner_starting_workers", "Workers asked for, not registered yet", registry=r
        )
        self.draining = Gauge("ferry_planner_draining_workers", "Workers draining", registry=r)
        self.concurrency = Gauge(
            "ferry_planner_concurrency", "Interactive sequences running, waiting or unread", registry=r
        )
        self.predicted = Gauge(
            "ferry_planner_predicted_concurrency", "Concurrency forecast for the next interval", registry=r
        )
        self.capacity = Gauge(
            "ferry_planner_worker_capacity", "Estimated sequences per worker within the targets", registry=r
        )
        self.ttft_p90 = Gauge("ferry_planner_ttft_p90_seconds", "TTFT p90 over the last interval", registry=r)
        self.itl_p90 = Gauge("ferry_planner_itl_p90_seconds", "ITL p90 over the last interval", registry=r)
        self.pool_lag = Gauge(
            "ferry_planner_pool_lag", "Batch items not yet taken from the pool topic", registry=r
        )
        self.errors = Counter(
            "ferry_planner_errors", "Intervals whose observation or action failed", registry=r
        )
