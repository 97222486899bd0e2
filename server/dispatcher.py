"""The frontend's requests out: GenerateRequests and Cancels produced to the worker topics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from bus.produce import TrackingProducer, forget_topics, send_and_wait
from bus.read_spec import Options
from bus.topics import RequestTopics, ensure_topics
from kvstore.bells import Bells
from schemas.kafka import Cancel, Chunk, GenerateRequest, request_encoder
from server.errors import broker_unavailable
from server.metrics import FrontendMetrics

log = logging.getLogger("ferry.frontend")

# Requests whose topic the dispatcher remembers (for their cancels and delivery checks).
SENT_REMEMBERED = 65536
# A request acknowledged later than this after it was sent rings its worker again: the inbox its first ring woke
# polls for `Options.linger_ms` (20 ms) before it sleeps, and might not have found the request in time.
LATE_ACK_S = Options.linger_ms / 2 / 1000


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
        self._bells = bells  # rings a worker: for a request once it is sent, for a cancel once it is in its topic
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
        bells = self._bells
        # Rung as soon as the request is on its way, not once the broker acknowledged it: the ring crosses Redis
        # while the produce crosses the broker, and the woken inbox's fetch reaches the broker after the produce
        # did (not awaited: a slow Redis must not hold up the request; an unrung inbox reads it at its poll).
        ring = functools.partial(bells.ring_soon, worker_id) if bells is not None else None
        try:
            async with asyncio.timeout(self._timeout_s):
                topic = await self._topic(worker_id)
                # Partition 0 is the only one a worker reads.
                sent = await send_and_wait(
                    self._producer,
                    topic,
                    request_encoder.encode(request),
                    key=request.request_id.encode(),
                    on_sent=ring,
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
            raise broker_unavailable() from exc
        if not self._broker_ok:
            log.info("Kafka is taking requests again")
            self._broker_ok = True
        if ring is not None and time.perf_counter() - t0 > LATE_ACK_S:
            ring()  # the inbox the first ring woke may have gone back to sleep before the request was in
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
            raise broker_unavailable() from exc

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
