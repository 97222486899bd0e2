"""Checks of a reader's partitions (bus/log_watch.py) while its assignment changes under them."""

from __future__ import annotations

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
