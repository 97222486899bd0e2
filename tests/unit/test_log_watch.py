"""Checks of a reader's partitions (bus/log_watch.py) while its assignment changes under them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import TopicPartition
from aiokafka.errors import IllegalStateError

from bus.log_watch import positions_and_ends


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
