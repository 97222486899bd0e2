"""A reader woken by a ring whose brief poll found nothing while a longer fetch may still be parked at the broker
sleeps only until that fetch is back (bus/doorbell.py, `ParkedFetch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from aiokafka import TopicPartition

from bus.doorbell import PAST_FETCH_MS, Doorbell, ParkedFetch
from bus.read_spec import Batch, Hooks, Options, Poll
from bus.reader import Reader

TP = TopicPartition("t", 0)


def test_an_empty_poll_after_a_ring_shorter_than_the_fetch_wait_bounds_the_next_sleep() -> None:
    p = ParkedFetch(wait_ms=100)
    p.polled(woke=10.0, wait_ms=100, poll_ms=20, fetched=False)
    assert p.sleep_s(0.98, now=10.02) == pytest.approx((100 + PAST_FETCH_MS) / 1000 - 0.02)


def test_the_sleep_is_whole_after_a_poll_that_read_was_not_woken_or_outlasted_the_fetch() -> None:
    for woken, fetched, wait_ms in [(True, True, 100), (False, False, 100), (True, False, 5)]:
        p = ParkedFetch(wait_ms=wait_ms)
        p.polled(woke=10.0 if woken else None, wait_ms=wait_ms, poll_ms=20, fetched=fetched)
        assert p.sleep_s(0.98, now=10.02) == 0.98


def test_a_fetch_of_the_poll_before_counts_when_the_wait_shrank_since() -> None:
    """A busy inbox's paced wait drops back between polls; the fetch sent at the longer one may be parked."""
    p = ParkedFetch(wait_ms=50)
    p.polled(woke=10.0, wait_ms=5, poll_ms=20, fetched=False)
    assert p.sleep_s(0.98, now=10.02) == pytest.approx((50 + PAST_FETCH_MS) / 1000 - 0.02)
    p.polled(woke=11.0, wait_ms=5, poll_ms=20, fetched=False)
    assert p.sleep_s(0.98, now=11.02) == 0.98


class Raw:
    def decode(self, buf: bytes, /) -> bytes:
        return buf


@dataclass
class Consumer:
    """Fetches nothing; its partition's end is known, so the reader sleeps after an empty poll."""

    paused_tps: set[TopicPartition] = field(default_factory=set)

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict:
        return {}

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def paused(self) -> set[TopicPartition]:
        return set(self.paused_tps)

    def pause(self, *tps: TopicPartition) -> None:
        self.paused_tps.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused_tps.difference_update(tps)

    def highwater(self, tp: TopicPartition) -> int | None:
        return 0


@dataclass
class Stretch:
    wait_ms: int
    stretched: bool = False

    async def after_poll(self, got: bool) -> None:
        pass


class Bell(Doorbell):
    """Remembers how long each sleep could last."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float] = []

    async def wait(self, timeout_s: float) -> bool:
        self.timeouts.append(timeout_s)
        return await super().wait(0)


async def _nothing(batch: Batch[bytes]) -> None:
    pass


async def test_the_reader_sleeps_until_the_parked_fetch_is_back_then_its_whole_timeout() -> None:
    bell = Bell()
    options = Options(fetch_wait_ms=100, linger_ms=20, poll=Poll(1000))
    reader: Reader[bytes] = Reader("test", "127.0.0.1:1", Raw(), options, doorbell=bell)
    consumer, stretch = Consumer(), Stretch(wait_ms=100)
    reader._consumer = consumer  # type: ignore[assignment]

    async def round() -> None:
        await reader._round(Hooks(_nothing), consumer, stretch, None)  # type: ignore[arg-type]

    await round()  # an empty poll: the next round sleeps
    bell.ring()
    await round()  # woken by the ring at once; its poll finds nothing
    await round()  # the sleep lasts until the fetch that may be parked is back
    await round()  # that one ended by its timeout: a whole sleep
    first, parked, whole = bell.timeouts
    assert first == whole == 0.98
    assert 0 < parked <= (100 + PAST_FETCH_MS) / 1000
    assert consumer.paused_tps == set()
