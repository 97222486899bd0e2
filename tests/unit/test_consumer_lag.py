"""The consumer-lag gauge follows the topics a reader holds: rolled-away topics leave the exposition."""

from __future__ import annotations

from typing import Any, cast

from prometheus_client import CollectorRegistry

from bus.lag_gauge import ConsumerLag
from bus.reader import Reader


class _Reader:
    def __init__(self, group: str) -> None:
        self.group = group
        self.lags: dict[str, int] = {}

    async def lag(self) -> dict[str, int]:
        return dict(self.lags)


def _series(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    return {
        (s.labels["topic"], s.labels["group"]): s.value
        for f in registry.collect()
        for s in f.samples
        if s.name == "ferry_kafka_consumer_lag"
    }


async def test_topics_a_reader_left_are_removed_and_other_groups_kept() -> None:
    registry = CollectorRegistry()
    gauge = ConsumerLag(registry)
    replies, inbox = _Reader("replies"), _Reader("inbox")
    replies.lags = {"ferry.replies.f.1": 3}
    inbox.lags = {"ferry.requests.w.e1": 1}
    await gauge.record(cast(Reader[Any], replies))
    await gauge.record(cast(Reader[Any], inbox))
    replies.lags = {"ferry.replies.f.2": 5}
    await gauge.record(cast(Reader[Any], replies))
    assert _series(registry) == {("ferry.replies.f.2", "replies"): 5, ("ferry.requests.w.e1", "inbox"): 1}


async def test_an_empty_reading_keeps_the_last_one() -> None:
    registry = CollectorRegistry()
    gauge = ConsumerLag(registry)
    reader = _Reader("g")
    reader.lags = {"t": 2}
    await gauge.record(cast(Reader[Any], reader))
    reader.lags = {}
    await gauge.record(cast(Reader[Any], reader))
    assert _series(registry) == {("t", "g"): 2}
