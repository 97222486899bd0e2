"""`ferry usage`: parsing --since, reading past the broker's skipped fetches, grouping and rendering."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka import TopicPartition

from bus.reader import GAP_TRIES
from launch.usage import Holes, parse_since, render, summarize
from schemas.tenants import UsageRecord


def test_since_takes_durations_and_iso_times() -> None:
    assert parse_since("90m", now=10_000.0) == 10_000.0 - 5400
    assert parse_since("2d", now=200_000.0) == 200_000.0 - 172_800
    assert parse_since("2026-01-02T03:04:05") == dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC).timestamp()
    with pytest.raises(SystemExit, match="--since 'yesterday'"):
        parse_since("yesterday")


def test_summary_by_tenant_model_and_key_as_table_and_csv() -> None:
    recs = [
        UsageRecord(at=1, tenant="a", key_id="k1", model="m", prompt_tokens=10, completion_tokens=5),
        UsageRecord(at=2, tenant="a", key_id="k2", model="n", prompt_tokens=1, errors=1),
        UsageRecord(at=3, tenant="b", key_id="k3", model="m", completion_tokens=7, cached_tokens=2),
    ]
    by_tenant = summarize(recs, "tenant")
    assert by_tenant["a"] == {
        "requests": 2,
        "errors": 1,
        "prompt_tokens": 11,
        "cached_tokens": 0,
        "completion_tokens": 5,
    }
    assert set(summarize(recs, "model")) == {"m", "n"} and set(summarize(recs, "key")) == {"k1", "k2", "k3"}
    assert render(by_tenant, "tenant", True).splitlines() == [
        "tenant,requests,errors,prompt_tokens,cached_tokens,completion_tokens", "a,2,1,11,0,5", "b,1,0,0,2,7",
    ]  # fmt: skip
    table = render(by_tenant, "tenant", False).splitlines()
    assert table[0].split() == [
        "tenant",
        "requests",
        "errors",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    ]
    assert table[1].split() == ["a", "2", "1", "11", "0", "5"]


class FakeConsumer:
    """Records where `ferry usage` moved the consumer."""

    def __init__(self) -> None:
        self.seeks: list[int] = []

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Note the move."""
        self.seeks.append(offset)


def test_a_fetch_that_skipped_records_is_read_again() -> None:
    tp = TopicPartition("ferry.usage", 0)
    rec = [SimpleNamespace(offset=i) for i in range(6)]
    holes, consumer = Holes({tp: 0}), FakeConsumer()
    got = holes.whole(cast(Any, consumer), tp, [rec[0], rec[1], rec[4], rec[5]])
    assert [r.offset for r in got] == [0, 1] and consumer.seeks == [2]
    # Read again from the hole: what was already taken is not taken twice.
    got = holes.whole(cast(Any, consumer), tp, rec[1:])
    assert [r.offset for r in got] == [2, 3, 4, 5] and consumer.seeks == [2]


def test_a_hole_that_stays_is_read_past() -> None:
    tp = TopicPartition("ferry.usage", 0)
    holes, consumer = Holes({tp: 0}), FakeConsumer()
    batch = [SimpleNamespace(offset=0), SimpleNamespace(offset=3)]
    for _ in range(GAP_TRIES):
        holes.whole(cast(Any, consumer), tp, batch)
    got = holes.whole(cast(Any, consumer), tp, batch)
    assert [r.offset for r in got] == [3] and len(consumer.seeks) == GAP_TRIES
