"""A worker rings a sleeping replies reader exactly when one of its records lies at or after where the reader
stopped, whichever of the record's acknowledgement and the reader's notice comes first (workers/reply_bells.py)."""

from __future__ import annotations

import pytest

from schemas.bells import RepliesAsleep, asleep_encoder
from workers import reply_bells
from workers.reply_bells import ReplyBells


def notice(channel: str, **positions: int) -> bytes:
    return asleep_encoder.encode(RepliesAsleep(channel, positions))


def bells() -> tuple[ReplyBells, list[str]]:
    rung: list[str] = []
    return ReplyBells(rung.append), rung


def test_a_record_acknowledged_after_the_notice_rings_once() -> None:
    b, rung = bells()
    b.heard(notice("fe1", t=10))
    b.acked("t", 9)  # read already
    assert rung == []
    b.acked("t", 10)
    assert rung == ["fe1"]
    b.acked("t", 11)  # one ring wakes the reader; it announces its next sleep afresh
    assert rung == ["fe1"]


def test_a_record_acknowledged_before_the_notice_rings_when_the_notice_arrives() -> None:
    b, rung = bells()
    b.acked("t", 12)
    b.heard(notice("fe1", t=12))
    assert rung == ["fe1"]
    b.acked("t", 13)
    assert rung == ["fe1"]


def test_a_reader_that_has_read_everything_is_not_rung() -> None:
    b, rung = bells()
    b.acked("t", 12)
    b.heard(notice("fe1", t=13))
    assert rung == [] and b.rung == 0


def test_records_in_other_topics_ring_only_their_own_readers() -> None:
    b, rung = bells()
    b.heard(notice("fe1", a=0, a1=5))
    b.heard(notice("fe2", b=3))
    b.acked("c", 100)
    assert rung == []
    b.acked("b", 3)
    b.acked("a1", 5)
    assert rung == ["fe2", "fe1"]


def test_one_ring_per_notice_when_several_of_its_topics_were_written() -> None:
    b, rung = bells()
    b.acked("a", 4)
    b.acked("a1", 9)
    b.heard(notice("fe1", a=0, a1=0))
    assert rung == ["fe1"]


def test_an_unreadable_notice_is_ignored() -> None:
    b, rung = bells()
    b.heard(b"\xc1 not msgpack")
    b.acked("t", 0)
    assert rung == []


def test_memory_is_bounded_by_the_oldest_topics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reply_bells, "REMEMBERED_TOPICS", 3)
    b, rung = bells()
    for i in range(5):
        b.acked(f"t{i}", 7)
        b.heard(notice("fe", **{f"u{i}": 1}))
    assert len(b._acked) == 3 and len(b._asleep) == 3
    b.heard(notice("fe", t4=7))  # remembered: rings
    b.heard(notice("fe", t0=7))  # forgotten: waits for its next record
    assert rung == ["fe"]
