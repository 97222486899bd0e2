"""Topics rolled by the wall clock and read by a consumer group: which epoch is current, which are read up.

The pool and batch results topics (`--pool-roll-s`) roll like this: writers send to the epoch of the clock,
group members subscribe by a pattern matching every epoch, and one party deletes an epoch once it is past and
its group has committed the end of every partition (docs/architecture.md, broker quirk "no DeleteRecords,
no retention").
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas.names import request_epoch


class EpochTopics:
    """One family of topics rolled every `roll_s` seconds of the wall clock: `name(epoch)`."""

    # An epoch is deleted no sooner than this long after it ended: a record sent in its last moments can
    # take that long to land (producers time out after 10 s), and its writer stops tracking the topic's
    # metadata after 10 s idle (bus/produce.py, broker quirk "metadata re-creates topics"). Longer than both.
    GRACE_S = 30.0

    def __init__(
        self, name: Callable[[int | None], str], roll_s: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.name = name
        self.roll_s = roll_s
        self.grace_s = self.GRACE_S
        self.clock = clock  # the wall clock (tests move it)
        self.pattern = re.compile(rf"^{re.escape(name(None))}(\.e[0-9]+)?$")

    @property
    def rolled(self) -> bool:
        """True when the topics roll (else there is one topic, `name(None)`)."""
        return self.roll_s > 0

    def epoch(self) -> int | None:
        """The current epoch (None without rolling)."""
        return int(self.clock() // self.roll_s) if self.roll_s > 0 else None

    def current(self) -> str:
        """The topic written to now."""
        return self.name(self.epoch())

    def route(self, topic: str) -> str:
        """The current epoch for the family's unrolled name (what batch items name), any other topic as it is."""
        return self.current() if topic == self.name(None) else topic

    def ahead(self) -> str:
        """The next epoch's topic (created before anyone writes there)."""
        e = self.epoch()
        return self.name(None if e is None else e + 1)

    def ahead_due(self) -> bool:
        """True once the next epoch should exist: `grace_s` into the current one (or at once, for epochs that
        short). Every topic added or deleted rebalances the group that reads by pattern (seconds on the
        embedded broker), so the next epoch is made when the last is deleted: members see both in one
        metadata refresh, one rebalance an epoch, and still have most of an epoch to find the new topic."""
        e = self.epoch()
        return e is not None and (
            self.grace_s >= self.roll_s / 2 or self.clock() >= e * self.roll_s + self.grace_s
        )

    def over(self, topic: str) -> bool:
        """True for a rolled topic of this family whose epoch ended `grace_s` ago or more (nobody writes there)."""
        t = request_epoch(topic)
        return (
            self.roll_s > 0
            and t is not None
            and self.pattern.match(topic) is not None
            and self.clock() >= (t + 1) * self.roll_s + self.grace_s
        )


async def group_offsets(
    bootstrap: str, group: str, select: Callable[[str], object]
) -> dict[TopicPartition, tuple[int, int]]:
    """(committed, end) of `group` on every partition of the topics `select` picks among those listed now.

    A partition with no commit counts as committed at 0. A fresh client lists every topic (its bootstrap
    metadata), so no topic is asked for by name (broker quirk "metadata re-creates topics"); nothing is
    tracked after it stops.
    """
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        await consumer.start()
        await admin.start()
        # The bootstrap metadata covers every topic: the leaders end_offsets needs.
        listed = sorted(t for t in consumer._client.cluster.topics() if select(t))
        tps = [TopicPartition(t, p) for t in listed for p in consumer.partitions_for_topic(t) or ()]
        if not tps:
            return {}
        ends = await consumer.end_offsets(tps)
        committed = await admin.list_consumer_group_offsets(group, partitions=tps)
    finally:
        await consumer.stop()
        await admin.close()
    out = {}
    for tp in tps:
        meta = committed.get(tp)
        out[tp] = (meta.offset if meta is not None and meta.offset >= 0 else 0, ends.get(tp, 0))
    return out


async def read_up(bootstrap: str, group: str, topics: list[str]) -> list[str]:
    """Those of `topics` the broker lists whose every partition `group` has committed to its end (a partition
    never written, end 0, counts as read; a topic whose partitions are unknown does not)."""
    if not topics:
        return []
    wanted = set(topics)
    offsets = await group_offsets(bootstrap, group, wanted.__contains__)
    seen = {tp.topic for tp in offsets}
    unread = {tp.topic for tp, (done, end) in offsets.items() if done < end}
    return [t for t in topics if t in seen and t not in unread]


def metadata_age_ms(roll_s: float) -> int | None:
    """The metadata refresh period of a pattern subscription to topics rolled every `roll_s` (None: not rolled).

    A quarter of an epoch, at most 30 s: an epoch is created an epoch ahead, so members find it before the
    first record lands there; an all-topic metadata request is cheap, yet no need to ask every few ms.
    """
    return None if roll_s <= 0 else max(200, min(30_000, int(roll_s * 250)))
