"""Which request topics a worker reads and may delete as the clock turns epochs (`RequestTopics`, bus/topics.py)."""

from __future__ import annotations

from aiokafka import TopicPartition

from bus.topics import RequestTopics
from schemas.names import request_topic
from workers.inbox import read_through


def topics_at(now: list[float], roll_s: float = 60.0) -> RequestTopics:
    return RequestTopics(roll_s, clock=lambda: now[0])


def names(*epochs: int) -> list[str]:
    return [request_topic("w", e) for e in epochs]


def test_the_next_epoch_joins_the_window_when_the_one_before_may_go_so_the_turn_changes_nothing() -> None:
    now = [600.0]  # the start of epoch 10; the grace is 30 s
    t = topics_at(now)
    assert t.window("w") == names(9, 10) and not t.deletable(request_topic("w", 9))
    now[0] = 629.9
    assert t.window("w") == names(9, 10)
    now[0] = 630.0  # epoch 9 ended 30 s ago: it may go, and epoch 11 comes in
    assert t.ahead_due() and t.window("w") == names(9, 10, 11)
    assert t.deletable(request_topic("w", 9)) and not t.deletable(request_topic("w", 10))
    read_after_half = set(names(10, 11))
    now[0] = 660.0  # the turn: epoch 11 is current and was read since 630
    assert read_after_half <= set(t.window("w")) and t.window("w") == names(10, 11)
    assert not t.deletable(request_topic("w", 10)) and not t.deletable(request_topic("w", 11))
    assert t.current("w") == request_topic("w", 11)


def test_short_epochs_read_the_next_one_half_way_and_delete_only_after_the_grace() -> None:
    now = [100.0]
    t = topics_at(now, roll_s=2.0)  # grace 30 s > half an epoch
    assert t.window("w") == names(49, 50)
    now[0] = 101.0
    assert t.window("w") == names(49, 50, 51)
    assert not t.deletable(request_topic("w", 49))  # ended 2 s ago
    now[0] = 130.0
    assert t.deletable(request_topic("w", 49)) and not t.deletable(request_topic("w", 64))


def test_unrolled_topics_never_move() -> None:
    t = RequestTopics(0.0)
    assert t.window("w") == [request_topic("w")] and not t.ahead_due()
    assert not t.deletable(request_topic("w", 1)) and not t.behind(request_topic("w", 1))


def test_a_topic_behind_the_window_is_read_through_only_at_its_end() -> None:
    paused_tp = TopicPartition("paused", 0)
    ends = {"read": (7, 7), "unread": (3, 7), "paused": (7, 7), "lost": (40, 2)}
    behind = ["read", "unread", "paused", "lost", "never-fetched"]
    # A position past the end is a log the broker lost and written again since (an empty restart): deleting
    # it then deleted the requests sent there after the restart, unread (a chaos run hung on them).
    assert read_through(behind, ends, {paused_tp}) == ["read"]
