"""`ferry usage`: parsing --since, grouping and rendering."""

from __future__ import annotations

import datetime as dt

import pytest

from launch.usage import parse_since, render, summarize
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
