"""Which pool and batch results epoch is current, due, and over (`--pool-roll-s`, bus/epochs.py)."""

from __future__ import annotations

import functools
import re

from bus.epochs import EpochTopics, metadata_age_ms
from schemas.names import batch_results_pattern, batch_results_topic, pool_pattern, pool_topic


def family(now: list[float], roll_s: float = 100.0) -> EpochTopics:
    return EpochTopics(functools.partial(pool_topic, "m"), roll_s, clock=lambda: now[0])


def test_writers_use_the_epoch_of_the_clock_and_results_go_to_the_current_epoch_whatever_the_item_named() -> (
    None
):
    now = [1050.0]
    pool = family(now)
    assert pool.current() == "ferry.pool.m.e10" and pool.ahead() == "ferry.pool.m.e11"
    results = EpochTopics(functools.partial(batch_results_topic, "m"), 100.0, clock=lambda: now[0])
    assert results.route("ferry.batch.results.m") == "ferry.batch.results.m.e10"
    now[0] = 1_000_000.0  # an item queued hours ago: its results go to the epoch of the send
    assert results.route("ferry.batch.results.m") == "ferry.batch.results.m.e10000"
    assert results.route("ferry.replies.fe-1") == "ferry.replies.fe-1"  # an interactive reply as it is
    unrolled = EpochTopics(functools.partial(pool_topic, "m"), 0.0)
    assert unrolled.current() == "ferry.pool.m" and not unrolled.rolled
    assert unrolled.route("ferry.pool.m") == "ferry.pool.m" and not unrolled.over("ferry.pool.m.e1")


def test_an_epoch_is_over_a_grace_after_it_ended_and_only_an_epoch_of_its_own_family() -> None:
    now = [1029.0]
    pool = family(now)
    assert not pool.over("ferry.pool.m.e9")  # e9 ended at 1000; the grace is 30 s
    now[0] = 1030.0
    assert pool.over("ferry.pool.m.e9") and not pool.over("ferry.pool.m.e10")
    assert not pool.over("ferry.pool.m")  # the unrolled topic is never deleted
    assert not pool.over("ferry.pool.m2.e1") and not pool.over("ferry.pool.other.e1")
    assert not pool.over("ferry.batch.results.m.e1")


def test_the_next_epoch_is_made_when_the_last_ones_grace_ends() -> None:
    now = [1010.0]
    pool = family(now)
    assert not pool.ahead_due()  # one topic change per rebalance: made with the deletion of e9
    now[0] = 1030.0
    assert pool.ahead_due()
    assert family([1001.0], roll_s=10.0).ahead_due()  # epochs shorter than twice the grace: at once


def test_patterns_match_every_epoch_of_the_model_and_nothing_else() -> None:
    for pattern, name in (
        (pool_pattern("m.x"), pool_topic),
        (batch_results_pattern("m.x"), batch_results_topic),
    ):
        rx = re.compile(pattern)
        assert rx.match(name("m.x")) and rx.match(name("m.x", 7))
        assert not rx.match(name("mAx")) and not rx.match(name("m.x.y")) and not rx.match(name("m.x") + ".e")


def test_members_refresh_metadata_within_a_quarter_of_an_epoch() -> None:
    assert metadata_age_ms(0.0) is None
    assert metadata_age_ms(3600.0) == 30_000
    assert metadata_age_ms(4.0) == 1000
