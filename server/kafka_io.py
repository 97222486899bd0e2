"""The frontend's replies in: one reader of its replies topics, each chunk handed to the stream it belongs to
(requests out: server/dispatcher.py)."""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from bus.doorbell import Doorbell
from bus.read_spec import Batch, Hooks, Options, Poll, Tail
from bus.reader import Reader
from bus.topics import delete_topics, ensure_topics
from schemas.kafka import ErrorInfo, ReplyMessage, chunks_of, reply_decoder
from server.errors import APIError
from server.metrics import FrontendMetrics
from server.reply_bell import OPEN_SLEEP_MS, RepliesBell
from server.streams import ClientStream, Sequence

log = logging.getLogger("ferry.frontend")

# How long a replies topic that could not roll (broker away) is used before the roll is tried again.
ROLL_RETRY_S = 1.0
# How long a retired replies topic that no resumable stream used is kept: nobody reads it back, so only
# as long as a worker may still write a late chunk there (a cancelled sequence's last one). Later, such a
# write would make the embedded broker create the topic again (broker quirk "metadata re-creates
# topics"); a worker's producer forgets a topic 10 s after its last write.
UNRESUMABLE_RETAIN_S = 60.0
# Most records the replies reader takes per poll.
REPLIES_MAX_RECORDS = 2048
_OPEN_POLL = Poll(OPEN_SLEEP_MS, REPLIES_MAX_RECORDS)


@dataclass
class _Tail:
    """One replies topic the demux reads: where it stands, and the streams whose chunks go there."""

    topic: str
    # Offset of the next record to read: every chunk of a request sent from now on lies at or after it.
    position: int
    streams: set[str] = field(default_factory=set)
    # A resumable stream replied here: the topic is kept for the resume TTL once retired.
    resumable: bool = False


class ReplyDemux:
    """Reads this frontend's replies topics and hands each chunk to the waiting client stream.

    New requests reply to the current topic. After `roll_records` records the demux starts a fresh one
    and reads the old one only while requests that reply there are open; `retain_s` later it deletes it
    (resumed streams read old chunks back until then; `UNRESUMABLE_RETAIN_S` when no stream that replied
    there was resumable, which under ordinary traffic is most topics): the embedded broker's fetches slow
    down as a partition grows (docs/architecture.md, broker quirk "slow long partitions"). A Kafka cluster does
    not need the roll, and `roll_records=0` turns it off.
    """

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        fetch_wait_ms: int = 100,
        roll_records: int = 0,
        retain_s: float = 600.0,
        metrics: FrontendMetrics | None = None,
        configs: dict[str, str] | None = None,
        doorbell: bool = False,
        workers_bell: RepliesBell | None = None,
    ) -> None:
        self._base = topic
        self._configs = configs  # retention of the replies topics (on Kafka; see `bus.topics.retention`)
        self._bootstrap = bootstrap
        self._roll_records = roll_records
        self._retain_s = retain_s
        self._metrics = metrics
        self._by_request: dict[str, ClientStream] = {}
        self._tails: dict[str, _Tail] = {}
        self._tail_of: dict[str, _Tail] = {}  # stream id -> the tail its chunks arrive on
        self._current: _Tail | None = None
        self._rolls = 0
        self._roll_after = 0.0  # monotonic time before which no roll is tried (after a failed one)
        self._reassign = False
        self._doomed: list[tuple[float, str]] = []  # (delete at, topic) of retired replies topics, in order
        self._deleting: asyncio.Task[None] | None = None
        # With nothing open there is nothing to read: the reader sleeps until a stream registers. With
        # `workers_bell` it also sleeps between an open stream's records, rung by the workers that write them.
        self._workers_bell = workers_bell
        self._bell = workers_bell.doorbell if workers_bell is not None else Doorbell() if doorbell else None
        self._reader = Reader(
            "replies",
            bootstrap,
            reply_decoder,
            Options(
                fetch_wait_ms=fetch_wait_ms,
                poll=Poll(1000, REPLIES_MAX_RECORDS),
                watch_reset=True,
                # Workers ring for whatever lies past the offsets announced before a sleep, however late it
                # was written (server/reply_bell.py): no fetch needs to go out just in case.
                linger_ms=fetch_wait_ms if workers_bell is not None else Options.linger_ms,
                sleep_after_records=workers_bell is not None,
            ),
            Hooks(
                self._handle,
                failed=self._fail_all,
                reset=self._log_lost,
                before_poll=self._before_poll,
                after_poll=self._after_poll,
                may_sleep=self._may_sleep,
                before_sleep=self._announce_sleep,
            ),
            self._bell,
        )
        self.failed: BaseException | None = None
        # Called when the broker lost this topic's log (restarted empty): chunks and requests in transit
        # went with it, so every open sequence must be sent again.
        self.on_reset: Callable[[], None] | None = None

    @property
    def topic(self) -> str:
        """The replies topic new requests name."""
        assert self._current is not None, "start() first"
        return self._current.topic

    @property
    def topics(self) -> list[str]:
        """Every replies topic being read (the current one last)."""
        return list(self._tails)

    @property
    def workers_bell(self) -> RepliesBell | None:
        """What workers ring this demux's reader with while streams are open (None: it polls then)."""
        return self._workers_bell

    @property
    def reader(self) -> Reader[ReplyMessage]:
        """The replies reader (for its consumer lag)."""
        return self._reader

    async def start(self) -> None:
        """Create the topic and position at its end before any request can be sent."""
        await ensure_topics(self._bootstrap, {self._base: 1}, self._configs)
        await self._reader.open(Tail(self._base))
        position = await self._reader.position(TopicPartition(self._base, 0))
        self._current = self._tails[self._base] = _Tail(self._base, position)
        self._reader.run()
        if self._workers_bell is not None:
            self._workers_bell.start()

    async def stop(self) -> None:
        """Stop reading (and deleting)."""
        await self._reader.stop()
        if self._workers_bell is not None:
            await self._workers_bell.stop()
        if self._deleting is not None:
            self._deleting.cancel()
            await asyncio.gather(self._deleting, return_exceptions=True)

    def register(self, stream: ClientStream, resumable: bool = False) -> tuple[str, int]:
        """Route chunks of every sequence of `stream` to it; a `resumable` one keeps its topic for `retain_s`.

        Returns the replies topic its requests must name and the offset its chunks will start at or after.
        """
        if self.failed is not None:
            raise APIError(503, "The reply stream of this frontend is down.", code="frontend_unavailable")
        tail = self._tail_of.get(stream.id)
        if tail is None:
            assert self._current is not None, "start() first"
            tail = self._tail_of[stream.id] = self._current
            tail.streams.add(stream.id)
        tail.resumable |= resumable
        for rid in stream.sequences:
            self._by_request[rid] = stream
        if self._bell is not None:
            self._bell.ring()
        return tail.topic, tail.position

    def unregister(self, stream: ClientStream) -> None:
        """Stop routing chunks to `stream` (late chunks are then dropped)."""
        for rid in stream.sequences:
            self._by_request.pop(rid, None)
        tail = self._tail_of.pop(stream.id, None)
        if tail is None:
            return
        tail.streams.discard(stream.id)
        if not tail.streams and tail is not self._current:
            self._retire(tail)

    def _retire(self, tail: _Tail) -> None:
        """Nothing open replies on `tail` any more: stop reading it, delete it once no resume can want it."""
        del self._tails[tail.topic]
        retain_s = self._retain_s if tail.resumable else min(self._retain_s, UNRESUMABLE_RETAIN_S)
        bisect.insort(self._doomed, (time.monotonic() + retain_s, tail.topic))
        self._reassign = True

    def open_sequences(self, worker_id: str | None) -> list[tuple[ClientStream, Sequence]]:
        """Every unfinished sequence running on `worker_id` (None: on any worker), with its stream."""
        out = []
        for rid, stream in self._by_request.items():
            seq = stream.sequences.get(rid)
            if seq is not None and worker_id in (None, seq.worker_id) and not seq.finished:
                out.append((stream, seq))
        return out

    def wake(self) -> None:
        """Something was written to a replies topic from this process (a frontend's note): read it now."""
        if self._bell is not None:
            self._bell.ring()

    async def _before_poll(self) -> Poll | None:
        if self._reassign:
            self._reassign = False
            await self._assign()
        # A sleep with streams open is bounded more tightly: a ring lost on its way costs them that long.
        return _OPEN_POLL if self._by_request else None

    def _may_sleep(self) -> bool:
        bell = self._workers_bell
        return not self._by_request or (bell is not None and bell.armed)

    async def _announce_sleep(self) -> None:
        bell = self._workers_bell
        if bell is not None and self._by_request:
            await bell.announce({t.topic: t.position for t in self._tails.values()})

    async def _handle(self, batch: Batch[ReplyMessage]) -> None:
        tail = self._tails.get(batch.tp.topic)
        if tail is not None:
            tail.position = batch.end
        by_request = self._by_request
        for _record, message in batch.messages:
            for chunk in chunks_of(message):
                stream = by_request.get(chunk.request_id)
                if stream is not None:
                    stream.put(chunk)

    async def _log_lost(self, rewound: list[TopicPartition]) -> None:
        for tp in rewound:
            if tp.topic in self._tails:
                self._tails[tp.topic].position = 0
        if self.on_reset is not None:
            self.on_reset()

    async def _after_poll(self, got_records: bool) -> None:
        # Deleting is an admin round trip: off the reading loop, so replies keep flowing meanwhile, and
        # whether or not this poll brought records (under steady load every poll does).
        if self._doomed and self._doomed[0][0] <= time.monotonic() and self._deleting is None:
            self._deleting = asyncio.create_task(self._delete_retired(), name="replies-delete")
        current = self._current
        if (
            current is not None
            and 0 < self._roll_records <= current.position
            and time.monotonic() >= self._roll_after
        ):
            await self._roll()

    def _fail_all(self, exc: BaseException) -> None:
        # Nobody else would ever answer the waiting streams: fail them all.
        self.failed = exc
        error = ErrorInfo("frontend_unavailable", f"reply consumer failed: {exc!r}", retriable=True)
        for rid, stream in list(self._by_request.items()):
            stream.fail(rid, error)

    async def _roll(self) -> None:
        """Start a fresh replies topic for new requests; the old one is read while its requests are open."""
        old = self._current
        assert old is not None
        topic = f"{self._base}.{self._rolls + 1}"
        try:
            await ensure_topics(self._bootstrap, {topic: 1}, self._configs)
        except (KafkaError, OSError, TimeoutError) as exc:
            # The broker is away (restarting): stay on the current topic and try again a little later.
            self._roll_after = time.monotonic() + ROLL_RETRY_S
            log.warning("replies: could not create %s, staying on %s for now: %r", topic, old.topic, exc)
            return
        self._rolls += 1
        new = self._tails[topic] = _Tail(topic, 0)
        await self._assign()
        # The position is resolved now, before any request names the topic (as for the first one).
        new.position = await self._reader.position(TopicPartition(topic, 0))
        self._current = new
        if not old.streams:
            self._retire(old)
        if self._metrics is not None:
            self._metrics.reply_topic_rolls.inc()
        log.info(
            "replies: new requests reply to %s (%s holds %d records; read on for %d open streams)",
            topic,
            old.topic,
            old.position,
            len(old.streams),
        )

    async def _assign(self) -> None:
        """Read exactly the live tails, each from its own position (assign() forgets positions)."""
        # A copy: a stream may end during an await in there and retire its tail (the next poll reassigns).
        await self._reader.assign({TopicPartition(t.topic, 0): t.position for t in self._tails.values()})

    async def _delete_retired(self) -> None:
        """Delete retired replies topics whose retention is over (best effort: Kafka may refuse)."""
        now = time.monotonic()
        due = [t for at, t in self._doomed if at <= now]
        self._doomed = [(at, t) for at, t in self._doomed if at > now]
        try:
            await delete_topics(self._bootstrap, due)
        except (KafkaError, OSError) as exc:
            log.warning("could not delete retired replies topics %s: %r", due, exc)
        else:
            log.info("replies: deleted retired topics %s", due)
        finally:
            self._deleting = None
