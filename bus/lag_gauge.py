"""`ferry_kafka_consumer_lag`: the backlog of each topic a process's reader holds now, and only of those."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from bus.reader import Reader


class ConsumerLag:
    """The lag gauge, with the label sets of topics a reader left (rolled and deleted ones) taken out."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauge = Gauge(
            "ferry_kafka_consumer_lag", "Records in a topic this process's consumer has not read yet",
            ["topic", "group"], registry=registry,
        )  # fmt: skip
        self._topics: dict[str, set[str]] = {}

    async def record(self, reader: Reader[Any]) -> None:
        """Set the lag of `reader`'s topics and remove those of topics it no longer reads."""
        lags = await reader.lag()
        if not lags:
            return  # no reading (not started, or between assignments): the last one stands
        group = reader.group
        # Reply, request and KV log topics roll: without this every topic ever read stays a series.
        for topic in self._topics.get(group, set()) - lags.keys():
            self.gauge.remove(topic, group)
        for topic, lag in lags.items():
            self.gauge.labels(topic, group).set(lag)
        self._topics[group] = set(lags)
