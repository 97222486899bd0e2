"""How long a reader with a doorbell polls before it sleeps: its linger, and past a fetch that may be parked."""

from __future__ import annotations

from dataclasses import dataclass, field

from aiokafka import TopicPartition

from bus.doorbell import PAST_FETCH_MS, Doorbell
from bus.read_spec import Batch, Hooks, Options, Poll
from bus.reader import Reader

TP = TopicPartition("t", 0)


class Raw:
    def decode(self, buf: bytes, /) -> bytes:
        return buf


@dataclass
class Consumer:
    """Fetches nothing; remembers each poll's timeout. The end of its partition is never known, so the reader
    never sleeps (a sleep would wait on the doorbell)."""

    timeouts: list[int] = field(default_factory=list)

    async def getmany(
        self, *tps: TopicPartition, timeout_ms: int = 0, max_records: int | None = None
    ) -> dict:
        self.timeouts.append(timeout_ms)
        return {}

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def highwater(self, tp: TopicPartition) -> int | None:
        return None


@dataclass
class Stretch:
    wait_ms: int
    stretched: bool = False

    async def after_poll(self, got: bool) -> None:
        pass


async def _nothing(batch: Batch[bytes]) -> None:
    pass


async def test_a_poll_outlasts_the_fetch_wait_of_the_round_before_and_its_own() -> None:
    """A ring can wake the reader while the last round's fetch is still parked at the broker (answered only near
    the end of its wait): the poll lasts past that wait, then the linger again once short fetches are back."""
    reader: Reader[bytes] = Reader(
        "test",
        "127.0.0.1:1",
        Raw(),
        Options(fetch_wait_ms=5, linger_ms=20, poll=Poll(1000)),
        doorbell=Doorbell(),
    )
    consumer = Consumer()
    stretch = Stretch(wait_ms=5)
    for wait in (5, 100, 5, 5):
        stretch.wait_ms = wait
        await reader._round(Hooks(_nothing), consumer, stretch, None)  # type: ignore[arg-type]
    assert consumer.timeouts == [20, 100 + PAST_FETCH_MS, 100 + PAST_FETCH_MS, 20]


async def test_a_reader_that_may_not_sleep_polls_its_whole_timeout() -> None:
    reader: Reader[bytes] = Reader("test", "127.0.0.1:1", Raw(), Options(poll=Poll(1000)))
    consumer = Consumer()
    await reader._round(Hooks(_nothing), consumer, Stretch(wait_ms=100), None)  # type: ignore[arg-type]
    assert consumer.timeouts == [1000]
