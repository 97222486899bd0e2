"""Keeping a reader moving: stretching its fetch wait while it lags, and noticing a log that was reset.

A broker can come back without the log a consumer was reading (an embedded broker restarted empty, a
Kafka topic deleted and recreated), and may answer a fetch past the new end with nothing rather than an
error (docs/architecture.md, broker quirk "empty restart"). `LogResetWatch` compares an idle consumer's
position with the high watermark its fetches report and starts it over from the beginning when the
position lies past that end, which a healthy log never allows. `FetchWaitAdjuster` keeps a reader of a
long partition moving (quirk "a slow read returns nothing").
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import IllegalStateError

log = logging.getLogger("ferry.kafka")

# Fetch wait of a reader that lags behind its log while its fetches come back empty (FetchWaitAdjuster).
LAGGING_FETCH_WAIT_MS = 500
# How often a reader that is getting records checks whether some partition makes no progress.
PROGRESS_CHECK_S = 0.2


class FetchWaitAdjuster:
    """Lengthens a consumer's fetch wait while it lags behind its log and its fetches come back empty.

    The embedded broker answers a fetch with no records when reading them outlasts the fetch's max wait
    (docs/architecture.md, broker quirk "a slow read returns nothing"). A longer wait costs nothing when
    records are there, so the adjuster switches to `lagging_wait_ms` while a partition's position lies
    below the high watermark of the latest fetch and goes back to the configured wait, which keeps idle
    readers prompt, once the reader has caught up. A Kafka cluster returns available records at once: it
    never triggers.
    """

    def __init__(
        self, consumer: AIOKafkaConsumer, name: str, lagging_wait_ms: int = LAGGING_FETCH_WAIT_MS
    ) -> None:
        self._consumer = consumer
        self._name = name
        self._lagging_wait_ms = lagging_wait_ms
        # aiokafka reads the wait from its fetcher for every request and has no public way to change it.
        self._fetcher = consumer._fetcher
        self._base_ms: int = self._fetcher._fetch_max_wait_ms
        self.stretched = False
        self._last: dict[TopicPartition, int] = {}
        self._checked_at = 0.0

    @property
    def wait_ms(self) -> int:
        """The fetch wait the consumer's next fetches carry."""
        return int(self._fetcher._fetch_max_wait_ms)

    def set_base(self, wait_ms: int) -> None:
        """The fetch wait of a reader that is not lagging (from now on; a stretched one keeps its stretch)."""
        if wait_ms == self._base_ms:
            return
        self._base_ms = wait_ms
        if not self.stretched:
            self._fetcher._fetch_max_wait_ms = wait_ms

    async def after_poll(self, got_records: bool) -> None:
        """Call after every poll with whether it returned records.

        Progress is judged per partition: with several assigned (rolled replies topics, pool partitions),
        records from a short one must not hide a long one that returns nothing.
        """
        now = time.monotonic()
        if got_records and not self.stretched and now - self._checked_at < PROGRESS_CHECK_S:
            return
        self._checked_at = now
        stuck = behind = 0
        positions = {}
        paused = self._consumer.paused()
        for tp, position, end in await positions_and_ends(self._consumer):
            positions[tp] = position
            if tp in paused or position >= end:
                continue
            behind += end - position
            if self._last.get(tp) == position:
                stuck += end - position
        self._last = positions
        if stuck and not self.stretched and self._lagging_wait_ms > self._base_ms:
            self.stretched = True
            self._fetcher._fetch_max_wait_ms = self._lagging_wait_ms
            log.info(
                "%s: fetches bring nothing of %d record(s) waiting (a broker slower to read than the %d ms "
                "fetch wait); waiting up to %d ms per fetch until caught up",
                self._name,
                stuck,
                self._base_ms,
                self._lagging_wait_ms,
            )
        elif self.stretched and not behind:
            self.stretched = False
            self._fetcher._fetch_max_wait_ms = self._base_ms


async def positions_and_ends(consumer: AIOKafkaConsumer) -> list[tuple[TopicPartition, int, int]]:
    """(partition, position, high watermark of its latest fetch) for each assigned partition that has both.

    The end is the high watermark fetch responses carry, not a ListOffsets answer (docs/architecture.md,
    broker quirk "ListOffsets short of the end").
    """
    out = []
    for tp in consumer.assignment():
        # A rebalance during an await below can take partitions of this list away (a pattern group over
        # rolled topics): aiokafka asserts on the high watermark of a partition no longer assigned.
        if tp not in consumer.assignment():
            continue
        end = consumer.highwater(tp)
        if end is None:
            continue
        try:
            # position() waits (up to the request timeout) while a position is being reset; a check
            # must never hold up the reader it watches. Not asyncio.wait_for: on Python 3.11 it swallows a
            # cancel that lands just as the awaited call finishes, and the loop running this check goes on.
            async with asyncio.timeout(0.05):
                position = await consumer.position(tp)
        except (TimeoutError, IllegalStateError):
            continue
        out.append((tp, position, end))
    return out


class LogResetWatch:
    """Rewinds a consumer's assigned partitions whose position lies beyond the log's end."""

    def __init__(self, consumer: AIOKafkaConsumer, name: str) -> None:
        self._consumer = consumer
        self._name = name
        self._checked_at = 0.0

    def due(self, got_records: bool) -> bool:
        """Whether to check after a poll: after every empty one, and every PROGRESS_CHECK_S while polls bring
        records. A reader whose other partitions keep bringing records (the next request epoch, a newer replies
        topic) still learns that the broker lost one partition's log, whose records would otherwise wait
        unread behind its old position."""
        now = time.monotonic()
        if got_records and now - self._checked_at < PROGRESS_CHECK_S:
            return False
        self._checked_at = now
        return True

    async def check(self) -> list[TopicPartition]:
        """Rewind the partitions whose position lies past their log's end; returns them."""
        rewound = []
        for tp, position, end in await positions_and_ends(self._consumer):
            if position > end:
                log.warning(
                    "%s: position %d is past the end (%d) of %s[%d]: the broker lost this log (restarted "
                    "empty?); reading it again from the start",
                    self._name,
                    position,
                    end,
                    tp.topic,
                    tp.partition,
                )
                rewound.append(tp)
        if rewound:
            await self._consumer.seek_to_beginning(*rewound)
        return rewound
