"""Routing policies over a fixed set of workers."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from schemas.status import WorkerStatus
from server.errors import APIError
from server.router import Router


def _w(wid: str, waiting: int = 0) -> WorkerStatus:
    return WorkerStatus(wid, "m", "sim", 64, 100, 2048, 0.0, 0.0, waiting=waiting)


def test_round_robin_cycles() -> None:
    r = Router("round_robin")
    workers = [_w("b"), _w("a"), _w("c")]
    assert [r.choose("m", workers, 10).worker_id for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_random_covers_every_worker() -> None:
    r = Router("random", random.Random(0))
    picks = Counter(r.choose("m", [_w("a"), _w("b")], 10).worker_id for _ in range(200))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 50


def test_least_loaded_uses_inflight_and_reported_waiting() -> None:
    r = Router("least_loaded", random.Random(0))
    workers = [_w("a"), _w("b", waiting=3)]
    for _ in range(3):
        d = r.choose("m", workers, 10)
        r.started(d.worker_id)
    assert r.inflight == Counter({"a": 3})
    r.started("a")  # a: 4 in flight; b: 3 waiting
    assert r.choose("m", workers, 10).worker_id == "b"
    for _ in range(4):
        r.finished("a")
    assert "a" not in r.inflight


def test_no_workers_is_503() -> None:
    with pytest.raises(APIError) as exc:
        Router("least_loaded").choose("m", [], 10)
    assert exc.value.status == 503 and exc.value.retry_after == 1
