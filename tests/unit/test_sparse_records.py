"""A reader learns that its records come an engine step apart, and then sleeps right after reading instead of
polling once more for nothing; records that follow closely again bring the brief poll back (bus/doorbell.py)."""

from __future__ import annotations

from bus.doorbell import SparseRecords

LINGER_S = 0.005


def test_two_empty_polls_after_records_in_a_row_make_records_sparse() -> None:
    s = SparseRecords(LINGER_S)
    s.polled(True)
    s.polled(False)  # the brief poll after records found nothing
    assert not s.sparse
    s.slept(0.05)
    s.polled(True)  # woken by a ring: read
    s.polled(False)
    assert s.sparse


def test_a_poll_right_after_a_sleep_is_not_a_brief_poll_after_records() -> None:
    """Only the poll that follows records without a sleep between tells whether more came at once."""
    s = SparseRecords(LINGER_S)
    for _ in range(3):
        s.polled(False)  # idle polls
        s.slept(0.05)
    assert not s.sparse


def test_records_following_at_once_reset_what_was_learned() -> None:
    s = SparseRecords(LINGER_S)
    for _ in range(2):
        s.polled(True)
        s.polled(False)
        s.slept(0.05)
    assert s.sparse
    s.polled(True)
    s.slept(0.001)  # a ring cut the sleep shorter than the brief poll: the next record came at once
    assert not s.sparse
    s.polled(True)
    s.polled(True)  # the brief poll found records: still dense
    s.polled(False)
    assert not s.sparse


def test_a_brief_poll_that_brings_records_starts_the_count_again() -> None:
    s = SparseRecords(LINGER_S)
    s.polled(True)
    s.polled(False)
    s.slept(0.05)
    s.polled(True)
    s.polled(True)  # more at once
    s.polled(False)
    assert not s.sparse
