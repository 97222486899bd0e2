"""The frontend's Kafka traffic: requests out to worker topics, replies in from its own topic."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from bus.doorbell import Doorbell
from bus.produce import TrackingProducer, forget_topics, send_and_wait
from bus.read_spec import Batch, Hooks, Options, Poll, Tail
from bus.reader import Reader
from bus.topics import RequestTopics, delete_topics, ensure_topics
from kvstore.bells import Bells
from schemas.kafka import (
    Cancel,
    Chunk,
    ErrorInfo,
    GenerateRequest,
    ReplyMessage,
    chunks_of,
    reply_decoder,
    request_encoder,
)
from server.errors import APIError
from server.metrics import FrontendMetrics
from server.reply_bell import OPEN_SLEEP_MS, RepliesBell
from server.streams import ClientStream, Sequence

log = logging.getLogger("ferry.frontend")

# How long a replies topic that could not roll (broker away) is used before the roll is tried again.
ROLL_RETRY_S = 1.0
# Requests whose topic the dispatcher remembers (for their cancels and delivery checks).
SENT_REMEMBERED = 65536
# How long a retired replies topic that no resumable stream used is kept: nobody reads it back, so only
# as long as a worker may still write a late chunk there (a cancelled sequence's last one). Later, such a
# write would make the embedded broker create the topic again (broker quirk "metadata re-creates
# topics"); a worker's producer forgets a topic 10 s after its last write.
UNRESUMABLE_RETAIN_S = 60.0
# Most records the replies reader takes per poll.
REPLIES_MAX_RECORDS = 2048
_OPEN_POLL = Poll(OPEN_SLEEP_MS, REPLIES_MAX_RECORDS)


class Dispatcher:
    """Produces GenerateRequests and Cancels to worker topics.

    With rolled request topics (`RequestTopics`) a request goes to its worker's topic of the current epoch,
    created first (a topic the embedded broker creates on a produce can vanish again: docs/architecture.md,
    broker quirk "lost again after a restart"); its cancel follows it into the same topic, so the worker
    reads the two in order.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        timeout_s: float,
        metrics: FrontendMetrics,
        topics: RequestTopics | None = None,
        configs: dict[str, str] | None = None,
        bootstrap: str = "",
        bells: Bells | None = None,
    ) -> None:
        self._producer = producer
        self._bells = bells  # rings a worker once its request or cancel is in its topic
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._broker_ok = True
        self.topics = topics or RequestTopics(0)  # which request topic is current
        self._configs = configs
        self._bootstrap = bootstrap
        self._created: set[str] = set()  # rolled topics known to exist
        self._creating: dict[str, asyncio.Future[None]] = {}  # rolled topics being created, by topic
        # (worker id, request id) -> the topic its request went to. Per worker: a disaggregated sequence has a
        # request on its prefill worker and one parked on its decode worker at once.
        self._sent_to: OrderedDict[tuple[str, str], str] = OrderedDict()
        # Called once a note is in a replies topic: this frontend's replies reader may be asleep.
        self.on_note: Callable[[], None] | None = None

    async def _topic(self, worker_id: str) -> str:
        """The topic a request to `worker_id` goes to now, created if this frontend has not yet."""
        while True:
            topic = self.topics.current(worker_id)
            if self.topics.roll_s <= 0 or topic in self._created:
                return topic
            # Before the new topic makes the producer refresh its metadata: the topics its workers will
            # delete must not be asked for (and so re-created) by that refresh.
            behind = lambda t: self.topics.behind(t, margin=1)  # noqa: E731
            if isinstance(self._producer, TrackingProducer):
                self._producer.forget_idle(also=behind)  # its notes' replies topics too
            else:
                forget_topics(self._producer, behind)
            # Every request to the worker in the first moments of an epoch needs the topic: one creation
            # for all of them, not one admin connection each.
            creating = self._creating.get(topic)
            if creating is None:
                creating = self._creating[topic] = asyncio.ensure_future(
                    ensure_topics(self._bootstrap, {topic: 1}, self._configs)
                )
                creating.add_done_callback(functools.partial(self._created_done, topic))
            await asyncio.shield(creating)
            self._created = {t for t in self._created if not self.topics.behind(t)}
            self._created.add(topic)
            if not self.topics.behind(topic, margin=1):
                return topic
            # The epoch turned more than once meanwhile (a slow broker): the worker no longer reads that one.

    def _created_done(self, topic: str, creating: asyncio.Future[None]) -> None:
        self._creating.pop(topic, None)
        if not creating.cancelled():
            creating.exception()  # retrieved: a caller that timed out meanwhile has its 503 already

    def topic_of(self, worker_id: str, request_id: str) -> str | None:
        """The topic `request_id` was sent to; None once its worker may have read and deleted that topic.

        Not as soon as the topic falls behind the worker's window: at short epochs every topic is behind
        by the time a request is looked up, and a request the broker lost there would never be sent again.
        """
        topic = self._sent_to.get((worker_id, request_id)) or self.topics.current(worker_id)
        return None if self.topics.maybe_deleted(topic) else topic

    async def submit(self, worker_id: str, request: GenerateRequest, cancel_on_timeout: bool = True) -> int:
        """Hand one request to a worker; returns its offset in the worker's topic, 503 if the broker does not
        acknowledge it in time.

        On a timeout the producer may still deliver the request later; unless told otherwise a cancel is
        queued behind it, so the worker does not run a request whose client already has its 503.
        """
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout_s):
                topic = await self._topic(worker_id)
                # Partition 0 is the only one a worker reads.
                sent = await send_and_wait(
                    self._producer,
                    topic,
                    request_encoder.encode(request),
                    key=request.request_id.encode(),
                )
        except (KafkaError, TimeoutError) as exc:
            self._metrics.kafka_errors.inc()
            if self._broker_ok:
                log.error("Kafka did not take a request (%r); answering 503 until it does", exc)
                self._broker_ok = False
            if cancel_on_timeout:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.cancel(worker_id, request.request_id)
            raise APIError(
                503,
                "The message broker is unavailable; try again shortly.",
                code="broker_unavailable",
                retry_after=2,
            ) from exc
        if not self._broker_ok:
            log.info("Kafka is taking requests again")
            self._broker_ok = True
        if self._bells is not None:
            # Not awaited: a slow Redis must not hold up the request (an unrung inbox reads it at its poll).
            self._bells.ring_soon(worker_id)
        self._sent_to[(worker_id, request.request_id)] = topic
        self._sent_to.move_to_end((worker_id, request.request_id))
        if len(self._sent_to) > SENT_REMEMBERED:
            self._sent_to.popitem(last=False)
        self._metrics.kafka_produce_seconds.observe(time.perf_counter() - t0)
        return sent.offset

    async def note(self, topic: str, chunk: Chunk) -> None:
        """Write a chunk of the frontend's own into a replies topic (a migration marker, an ending).

        Replies topics are the record a resumed stream is rebuilt from, so what the frontend decides
        about a sequence goes there too. Raises APIError (503) like `submit` if the broker does not
        acknowledge it in time.
        """
        try:
            async with asyncio.timeout(self._timeout_s):
                await send_and_wait(
                    self._producer, topic, request_encoder.encode(chunk), key=chunk.request_id.encode()
                )
            if self.on_note is not None:
                self.on_note()
        except (KafkaError, TimeoutError) as exc:
            self._metrics.kafka_errors.inc()
            raise APIError(
                503,
                "The message broker is unavailable; try again shortly.",
                code="broker_unavailable",
                retry_after=2,
            ) from exc

    async def cancel(self, worker_id: str, request_id: str, attempt: int = -1) -> None:
        """Ask a worker to abort a request (only its `attempt`, if given, running or parked); best effort (the
        worker also drops late requests)."""
        topic = self._sent_to.get((worker_id, request_id))
        try:
            # Behind the cancel goes to the current topic: its request was read long ago, and a topic behind
            # the worker's window may be gone.
            if topic is None or self.topics.behind(topic, margin=1):
                topic = await self._topic(worker_id)
            delivery = await self._producer.send(
                topic,
                request_encoder.encode(Cancel(request_id, attempt)),
                key=request_id.encode(),
                partition=0,
            )
            bells = self._bells
            if bells is not None:
                delivery.add_done_callback(
                    lambda d: None if d.cancelled() or d.exception() else bells.ring_soon(worker_id)
                )
        except (KafkaError, OSError) as exc:
            log.warning("could not send cancel for %s: %r", request_id, exc)


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
