"""Checks of a reader's partitions (bus/log_watch.py): while its assignment changes under them, and while its
polls keep bringing records."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError

from bus.log_watch import LogResetWatch, positions_and_ends
from bus.read_spec import Batch, Hooks, Options
from bus.reader import Reader


async def test_partitions_taken_away_while_the_check_awaits_are_skipped() -> None:
    # A rebalance (a pattern group over rolled topics) during the check's await took `b` away: aiokafka
    # asserts on its high watermark, which stopped a worker (test_pool_roll, once).
    a, b = TopicPartition("t", 0), TopicPartition("t", 1)
    assigned = {a, b}

    def highwater(tp: TopicPartition) -> int:
        assert tp in assigned, "Partition is not assigned"
        return 10

    async def position(tp: TopicPartition) -> int:
        if tp not in assigned:
            raise IllegalStateError(f"Partition {tp} is not assigned")
        assigned.discard(b if tp == a else a)  # the rebalance lands while this await is under way
        return 3

    consumer = SimpleNamespace(assignment=lambda: set(assigned), highwater=highwater, position=position)
    got = await positions_and_ends(consumer)  # type: ignore[arg-type]
    assert len(got) == 1 and got[0][1:] == (3, 10)


async def test_a_check_never_swallows_the_cancellation_of_its_task() -> None:
    # asyncio.wait_for (Python 3.11) returns the inner result when the cancel lands after the inner
    # awaitable finished and before the waiter resumed: a refresh loop checking its reader's lag then ran
    # on after WorkerPool.stop cancelled it, and the frontend never stopped (test_overload's teardown).
    tps = {TopicPartition("t", p) for p in range(4)}

    async def position(tp: TopicPartition) -> int:
        await asyncio.sleep(0)  # (as a position being resolved does)
        return 3

    consumer = SimpleNamespace(assignment=lambda: set(tps), highwater=lambda tp: 10, position=position)

    running = [True]  # (so that a loop whose cancel was swallowed still ends with the test)

    async def check_forever() -> None:
        while running[0]:
            await positions_and_ends(consumer)  # type: ignore[arg-type]

    swallowed = []
    try:
        for steps in range(12):  # the cancel lands at every point of a check
            task = asyncio.create_task(check_forever())
            for _ in range(steps):
                await asyncio.sleep(0)
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1.0)
            if not (done and task.cancelled()):
                swallowed.append(steps)
    finally:
        running[0] = False
    assert not swallowed, f"cancels swallowed after {swallowed} steps"


class Busy:
    """A consumer of two partitions: every poll brings a record of `busy`; `lost` lies past its log's end (an
    empty broker restart) until rewound. Records the rewinds and the commits."""

    def __init__(self) -> None:
        self.busy, self.lost = TopicPartition("busy", 0), TopicPartition("lost", 0)
        self.positions = {self.busy: 0, self.lost: 40}  # `lost`'s new log holds 2 records
        self.rewound: list[TopicPartition] = []
        self.commits: list[dict[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return {self.busy, self.lost}

    def paused(self) -> set[TopicPartition]:
        return set()

    def highwater(self, tp: TopicPartition) -> int:
        return self.positions[self.busy] + 1 if tp == self.busy else 2

    async def position(self, tp: TopicPartition) -> int:
        return self.positions[tp]

    async def getmany(self, timeout_ms: int = 0, max_records: int | None = None) -> dict:
        offset = self.positions[self.busy]
        self.positions[self.busy] += 1
        return {self.busy: [SimpleNamespace(offset=offset, value=b"")]}

    async def seek_to_beginning(self, *tps: TopicPartition) -> None:
        self.rewound.extend(tps)
        for tp in tps:
            self.positions[tp] = 0

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(offsets)


class Raw:
    def decode(self, buf: bytes, /) -> bytes:
        return buf


class NoStretch:
    wait_ms = 100
    stretched = False

    async def after_poll(self, got: bool) -> None:
        pass


async def rounds(consumer: Busy, n: int, **options: object) -> list[list[TopicPartition]]:
    """`n` rounds of a reader's loop over `consumer`; the partitions its reset hook was told of."""
    told: list[list[TopicPartition]] = []

    async def reset(tps: list[TopicPartition]) -> None:
        told.append(tps)

    async def handle(batch: Batch[bytes]) -> None:
        pass

    reader = Reader("test", "127.0.0.1:1", Raw(), Options(**options))  # type: ignore[arg-type]
    reader._consumer = consumer  # type: ignore[assignment]
    watch = LogResetWatch(consumer, "test")  # type: ignore[arg-type]
    for _ in range(n):
        await reader._round(Hooks(handle, reset=reset), consumer, NoStretch(), watch)  # type: ignore[arg-type]
    return told


async def test_a_lost_log_is_noticed_while_another_partition_keeps_bringing_records() -> None:
    # A worker's inbox reads several request epochs. After an empty broker restart the next epoch's requests
    # kept every poll busy, the lost epoch was checked only after an empty poll, and the requests sent there
    # since (offsets 0.., far below the reader's position) waited unread: chaos runs hung on them.
    consumer = Busy()
    told = await rounds(consumer, 3)
    assert consumer.rewound == [consumer.lost] and told == [[consumer.lost]]


async def test_while_polls_bring_records_the_check_runs_at_most_every_progress_check() -> None:
    consumer = Busy()
    watch = LogResetWatch(consumer, "test")  # type: ignore[arg-type]
    assert watch.due(True)  # the first time
    assert not watch.due(True)  # records again within PROGRESS_CHECK_S: not yet
    assert watch.due(False)  # an empty poll: always


async def test_a_poll_commits_only_the_partitions_it_moved() -> None:
    # Committing the others too would retry for COMMIT_TIMEOUT_S on a topic the broker forgot, the reader
    # stopped meanwhile. A check that found nothing to rewind keeps what the reader knows of the partitions.
    consumer = Busy()
    consumer.positions[consumer.lost] = 2  # at its end: read, not lost
    await rounds(consumer, 2, commit_after_poll=True)
    assert consumer.rewound == [] and consumer.commits == [{consumer.busy: 1}, {consumer.busy: 2}]
