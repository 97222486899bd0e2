"""What a bus.Reader is given: where it reads (`Tail`, `At`, `Own`, `Subscribe`), how its consumer is made and
polls (`Options`, `Poll`), the decoder of its records and the hooks it calls with what it read (`Hooks`, `Batch`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Decoder(Protocol[T_co]):
    """A typed msgspec decoder (MessagePack or JSON)."""

    def decode(self, buf: bytes, /) -> T_co:
        """The message a record's value holds; raises if it holds none."""
        ...


# ---- where a reader reads ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Tail:
    """Partition 0 of `topic` (created if missing) from its end, resolved at start: a lazy seek could skip
    records written between the start and the first fetch (replies to the first requests, acks of the first
    operation)."""

    topic: str


@dataclass(frozen=True)
class At:
    """Partition 0 of `topic` from `offset`."""

    topic: str
    offset: int


@dataclass(frozen=True)
class Own:
    """Partition 0 of `topic`, assigned by hand, from the last commit of `Options.group_id` (else `offset_reset`)."""

    topic: str


@dataclass(frozen=True)
class Subscribe:
    """A member of the consumer group `Options.group_id` reading `topics`, told of rebalances by `listener`.

    With `pattern`, `topics` is ignored and the member reads every topic whose name matches it, as the broker
    lists them (topics created later are found within `Options.metadata_max_age_ms`); a pattern asks for the
    metadata of every topic, never for one by name, so it never re-creates a deleted one on the embedded
    broker (docs/architecture.md, broker quirk "metadata re-creates topics").
    """

    topics: tuple[str, ...]
    listener: ConsumerRebalanceListener | None = None
    pattern: str | None = None


Start = Tail | At | Own | Subscribe


# ---- how it reads, and what it does with what it read -------------------------------------------------


# The fetch wait of readers whose records are batch work (items, their results, submissions over Kafka): no
# first token waits on them, and the embedded broker answers a parked fetch only near its end (broker quirk
# "late wake-up"), so an idle reader costs it one fetch per wait: two a second instead of ten at 100 ms.
BATCH_FETCH_WAIT_MS = 500
# How long an idle batch reader with a doorbell sleeps between polls when no writer rings (its writers ring once
# their records are in: kvstore/bells.py); a batch item or result waits at most this long for an unheard ring.
BATCH_SLEEP_MS = 5000
# How long such a reader's last poll before a sleep lasts: longer than a fetch, so that the sleep follows a fetch
# the broker answered empty, not one still on its way with records written before the last ring was cleared.
BATCH_LINGER_MS = BATCH_FETCH_WAIT_MS + 100
# How long aiokafka's background fetch routine waits for an event before it looks again (its
# `consumer_timeout_ms`, 200 by default). Every event it acts on (a fetch answered, records consumed, a seek, a
# partition resumed, a rebalance, a metadata update) wakes it at once, so the timeout only paces its wake-ups
# while nothing happens: a sleeping reader's paused partitions cost five of them a second at aiokafka's default.
FETCHER_IDLE_MS = 5000


@dataclass(frozen=True)
class Poll:
    """One fetch: how long it may wait for records, and how many it takes at most."""

    timeout_ms: int = 1000
    max_records: int = 256


@dataclass(frozen=True)
class Options:
    """How a reader's consumer is made and how its loop polls."""

    fetch_wait_ms: int = 100
    poll: Poll = Poll()
    # (a Reader with a doorbell) How long it polls without records before it sleeps: a few fetches at the short
    # fetch wait of the token path, so what a just-ended fetch missed (broker quirk "late wake-up") is read
    # before the reader depends on a ring that a writer sends only for records it wrote after the sleep began.
    linger_ms: int = 20
    # (a Reader with a doorbell) Once records have proven sparse, sleep right after a poll that brought some,
    # without the brief poll first (bus/doorbell.py, `SparseRecords`): only for a reader whose writers ring it
    # for any record past where it stopped, however soon after the sleep began they wrote it.
    sleep_after_records: bool = False
    # Check every empty poll, and polls with records every PROGRESS_CHECK_S, for a log the broker lost, and read
    # it again from the start (LogResetWatch).
    watch_reset: bool = False
    # Commit the consumer's positions after every poll that brought records (the handler has them by then).
    commit_after_poll: bool = False
    group_id: str | None = None
    offset_reset: str = "latest"  # aiokafka's auto_offset_reset: "latest", "earliest" or "none"
    client_id: str | None = None
    max_poll_records: int | None = None
    session_timeout_ms: int | None = None
    heartbeat_interval_ms: int | None = None
    # Give each member a range of adjacent partitions (aiokafka's default deals them out round-robin).
    range_assignor: bool = False
    # A group member stopping while its group join is under way gives the join this long, then leaves it
    # (None: waits for the join however long it takes; see `stop_consumer`).
    join_wait_s: float | None = None
    # How often the client refreshes its metadata unasked (None: aiokafka's 5 minutes); a pattern
    # subscription finds new topics no later than this.
    metadata_max_age_ms: int | None = None

    def make_consumer(self, bootstrap: str) -> AIOKafkaConsumer:
        """A consumer with these settings (offsets are only ever committed by hand)."""
        extra: dict[str, Any] = {}
        if self.client_id is not None:
            extra["client_id"] = self.client_id
        if self.max_poll_records is not None:
            extra["max_poll_records"] = self.max_poll_records
        if self.session_timeout_ms is not None:
            extra["session_timeout_ms"] = self.session_timeout_ms
        if self.heartbeat_interval_ms is not None:
            extra["heartbeat_interval_ms"] = self.heartbeat_interval_ms
        if self.metadata_max_age_ms is not None:
            extra["metadata_max_age_ms"] = self.metadata_max_age_ms
        if self.range_assignor:
            extra["partition_assignment_strategy"] = (RangePartitionAssignor,)
        return AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset=self.offset_reset,
            fetch_max_wait_ms=self.fetch_wait_ms,
            consumer_timeout_ms=FETCHER_IDLE_MS,
            **extra,
        )


@dataclass(slots=True)
class Batch(Generic[T]):
    """What one poll brought from one partition."""

    tp: TopicPartition
    messages: list[tuple[Any, T]]  # (aiokafka ConsumerRecord, its decoded value), in offset order
    dropped: list[Any]  # records that did not decode (logged)
    end: int  # the offset after the last record fetched, dropped ones included


@dataclass(frozen=True)
class Hooks(Generic[T]):
    """What a reader does with what it reads, and what its loop calls besides."""

    # Called with each partition's batch of every poll that brought records (also when none decoded).
    handle: Callable[[Batch[T]], Awaitable[None]]
    # The loop died: fail whoever waits on this reader (the reader has logged the exception).
    failed: Callable[[BaseException], None] | None = None
    # (Options.watch_reset) The broker lost these partitions' log; the reader reads them again from the start.
    reset: Callable[[list[TopicPartition]], Awaitable[None]] | None = None
    # Before each poll: its settings (None: the reader's own), after whatever must happen first.
    before_poll: Callable[[], Awaitable[Poll | None]] | None = None
    # After each poll, once its batches were handled, with whether it brought records.
    after_poll: Callable[[bool], Awaitable[None]] | None = None
    # A round failed: True to go on with the next one (after logging, backing off, rewinding), False to die.
    error: Callable[[Exception], Awaitable[bool]] | None = None
    # The loop has ended and the consumer is about to stop (a last commit).
    closing: Callable[[], Awaitable[None]] | None = None
    # (a Reader with a doorbell) Whether the reader may sleep now, after a poll without records; None: always.
    may_sleep: Callable[[], bool] | None = None
    # (a Reader with a doorbell) Just before it sleeps: tell whoever rings it where it stopped reading.
    before_sleep: Callable[[], Awaitable[None]] | None = None


def batch_options(fetch_wait_ms: int, **options: Any) -> Options:
    """Options of a reader of batch work: a fetch wait of BATCH_FETCH_WAIT_MS at least, the linger of its sleeps."""
    return Options(fetch_wait_ms=max(fetch_wait_ms, BATCH_FETCH_WAIT_MS), linger_ms=BATCH_LINGER_MS, **options)
