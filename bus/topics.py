"""Topic admin: creating topics (with their retention configs) and deleting them; rolled request topics."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from schemas.names import request_epoch, request_topic


@contextlib.asynccontextmanager
async def _admin(bootstrap: str) -> AsyncIterator[AIOKafkaAdminClient]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


def retention(seconds: float, max_bytes: int = -1) -> dict[str, str]:
    """Topic configs under which Kafka deletes records older than `seconds` (<= 0: never) or beyond
    `max_bytes` per partition (-1: no size bound).

    Apache Kafka enforces them; the embedded broker stores and describes them but never deletes a record
    (docs/architecture.md, broker quirk "no DeleteRecords, no retention"), so there Ferry rolls topics.
    """
    ms = int(seconds * 1000) if seconds > 0 else -1
    return {"cleanup.policy": "delete", "retention.ms": str(ms), "retention.bytes": str(max_bytes)}


async def ensure_topics(
    bootstrap: str, topics: dict[str, int], configs: dict[str, str] | None = None
) -> None:
    """Create each topic with its number of partitions (and `configs`) unless it exists.

    An existing topic keeps the configs it has: changing them is an operator's decision.
    """
    async with _admin(bootstrap) as admin:
        for topic, partitions in topics.items():
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [
                        NewTopic(
                            topic,
                            num_partitions=partitions,
                            replication_factor=1,
                            topic_configs=configs or {},
                        )
                    ]
                )


async def existing_topics(bootstrap: str, topics: list[str]) -> list[str]:
    """Those of `topics` the broker lists, in their order.

    Asks for every topic, never for these by name: the embedded broker creates a topic anew when asked for
    it by name (docs/architecture.md, broker quirk "metadata re-creates topics").
    """
    async with _admin(bootstrap) as admin:
        listed = set(await admin.list_topics())
    return [t for t in topics if t in listed]


async def list_topics(bootstrap: str) -> list[str]:
    """Every topic the broker lists (asked for all at once, none by name: see `existing_topics`)."""
    async with _admin(bootstrap) as admin:
        return list(await admin.list_topics())


async def delete_topics(bootstrap: str, topics: list[str]) -> None:
    """Delete topics (those already gone are fine)."""
    async with _admin(bootstrap) as admin:
        await admin.delete_topics(topics)


class RequestTopics:
    """Which request topic of a worker is current, by the wall clock.

    With `roll_s` > 0, requests to a worker go to `ferry.requests.<worker>.e<epoch>`, the epoch being
    the Unix time divided by `roll_s`: frontends and the worker agree on it without talking (their clocks
    must agree to well within `roll_s`). The worker reads the current epoch and `LAG` before it, and from
    `grace_s` into an epoch the next one as well: that is when the epoch before is deleted (once read), and
    the next one joins in the same move, so nothing is re-assigned when the epoch turns (a consumer that
    only found the new topic after the turn left the requests sent there waiting out its poll). A
    partition so never holds more than about an epoch of requests (docs/architecture.md, broker quirk
    "slow long partitions"); a request from a frontend whose clock runs ahead waits in its topic until the
    worker reads it. Each partition a worker reads costs the embedded broker CPU on every idle fetch, hence
    two at a time in the steady state. `roll_s` = 0: one topic per worker.
    """

    # Epochs behind the current one a worker still reads: records written just before the turn of the
    # epoch, and by a frontend whose clock lags.
    LAG = 1
    # An epoch is deleted no sooner than this long after it ended: a request sent in its last moments can
    # take that long to land (the frontend's send timeout, `--kafka-timeout-s`, 5 s), and the worker must
    # have fetched it before it judges the topic read; and a frontend's delivery check (`--delivery-check-s`,
    # 10 s) must still find the topic to tell a request the broker lost from one it holds. Longer than both.
    GRACE_S = 30.0

    def __init__(self, roll_s: float, clock: Callable[[], float] = time.time) -> None:
        self.roll_s = roll_s
        self.grace_s = self.GRACE_S
        self.clock = clock  # the wall clock (tests move it)

    def epoch(self) -> int | None:
        """The current epoch (None without rolling)."""
        if self.roll_s <= 0:
            return None
        return int(self.clock() // self.roll_s)

    def current(self, worker_id: str) -> str:
        """The topic a request to `worker_id` goes to now."""
        return request_topic(worker_id, self.epoch())

    def window(self, worker_id: str) -> list[str]:
        """The topics a worker reads now, oldest first: `LAG` epochs before the current one, the current one,
        and the next one once `ahead_due`."""
        e = self.epoch()
        if e is None:
            return [request_topic(worker_id)]
        last = e + 1 if self.ahead_due() else e
        return [request_topic(worker_id, n) for n in range(e - self.LAG, last + 1)]

    def ahead_due(self) -> bool:
        """True once the next epoch is read ahead: `grace_s` into the current one, when the epoch before may
        go (half-way through epochs shorter than two graces)."""
        e = self.epoch()
        return e is not None and self.clock() >= e * self.roll_s + min(self.grace_s, self.roll_s / 2)

    def between(self, worker_id: str, after: int, before: int) -> list[str]:
        """The rolled topics of the epochs strictly between `after` and `before`, oldest first."""
        return [request_topic(worker_id, n) for n in range(after + 1, before)]

    def deletable(self, topic: str) -> bool:
        """True for a rolled topic of an epoch before the current one that ended `grace_s` ago or more."""
        e, t = self.epoch(), request_epoch(topic)
        return e is not None and t is not None and t < e and self.clock() >= (t + 1) * self.roll_s + self.grace_s

    def maybe_deleted(self, topic: str) -> bool:
        """True for a rolled topic its worker may have deleted by now: its epoch ended `grace_s` ago, less an
        epoch for the clocks' difference. Until then it can be looked into (server/delivery.py)."""
        t = request_epoch(topic)
        if t is None or self.roll_s <= 0:
            return False
        return self.clock() >= t * self.roll_s + self.grace_s and self.behind(topic, margin=1)

    def behind(self, topic: str, margin: int = 0) -> bool:
        """True for a rolled topic older than the window (less `margin` epochs): nobody writes there any more.

        A worker deletes a topic of an earlier epoch once it has read all of it (`deletable`), so a writer
        that wants its record read (a cancel following its request) asks with a margin of an epoch.
        """
        e, t = self.epoch(), request_epoch(topic)
        return e is not None and t is not None and t < e - self.LAG + margin
