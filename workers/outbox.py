"""A worker's outgoing records: one queue and one sender, so each request's chunks stay in order.

Chunks are queued without waiting (the engine pushes a step's outputs from inside the step); the engine
waits for `room()` before its next step, so the queue pushes back on it when Kafka lags. What queued up while
the sender was busy goes out together: a topic's consecutive chunks become one `Chunks` record, so a busy
worker sends one record per frontend per round instead of one per token, and in it a sequence's chunks are
one. Rounds start at least `linger_s` apart (`--reply-linger-ms`, as Kafka's linger.ms): an engine stepping
faster than that sends several steps' tokens in one record instead of one record per step, which is what the
broker, the frontend's reader and its SSE writes pay for; what is put `urgent` (a first token, a lone
sequence's tokens, anything of an engine stepping slower than the linger: workers/serving.py) and messages to
other workers end the wait. A record the broker refuses is sent again behind what was queued since
(docs/architecture.md, "stale producer metadata").
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable
from typing import NamedTuple

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from bus.doorbell import Doorbell
from schemas.kafka import Chunk, Chunks, GenerateRequest, LoraAck, Release, joined_chunk, request_encoder
from workers.metrics import WorkerMetrics

log = logging.getLogger("ferry.worker")

# Produces of one reply record before it counts as lost.
SEND_TRIES = 3
# Records queued beyond which `room()` holds the engine back until the sender has taken them.
QUEUE_SIZE = 4096
# Most chunks in one record: keeps a record far below the broker's message size limit even with logprobs.
MAX_CHUNKS_PER_RECORD = 128

# Rewrites a request's chunk before it is queued; None holds it back (the pool consumer sends a batch
# item's output once, whole).
Coalescer = Callable[[GenerateRequest, Chunk], Chunk | None]


class Outgoing(NamedTuple):
    """One record on its way to a frontend's topic, and how often producing it failed so far."""

    topic: str
    key: bytes | None
    value: bytes
    tries: int = 0
    delivered: Callable[[], None] | None = None  # called once the broker has acknowledged it


class Reply(NamedTuple):
    """A chunk waiting in the queue for its request's reply topic (encoded when it is sent)."""

    topic: str
    chunk: Chunk


def records(items: list[Outgoing | Reply]) -> list[Outgoing]:
    """The records to send for what was queued, in order per topic: a topic's consecutive chunks in one."""
    out: list[Outgoing] = []
    groups: dict[str, list[Chunk]] = {}

    def flush(topic: str) -> None:
        chunks = groups.pop(topic, None)
        if not chunks:
            return
        for i in range(0, len(chunks), MAX_CHUNKS_PER_RECORD):
            part = joined(chunks[i : i + MAX_CHUNKS_PER_RECORD])
            if len(part) == 1:
                out.append(Outgoing(topic, part[0].request_id.encode(), request_encoder.encode(part[0])))
            else:
                out.append(Outgoing(topic, None, request_encoder.encode(Chunks(part))))

    for item in items:
        if isinstance(item, Reply):
            groups.setdefault(item.topic, []).append(item.chunk)
        else:
            flush(item.topic)  # what was queued before it for its topic goes first
            out.append(item)
    for topic in list(groups):
        flush(topic)
    return out


def joined(chunks: list[Chunk]) -> list[Chunk]:
    """`chunks` with each sequence's consecutive ones joined into one, placed where its first was.

    A record gathers about ten steps' tokens of each sequence (the linger); as one chunk each, the worker encodes
    and the frontend decodes, checks and hands on one struct per sequence instead of one per token. What must stay
    apart does: a chunk after an ending, an error, a sequence's first chunk with prompt logprobs (its head), and a
    different attempt of the same request (it starts a run of its own, after the one before it).
    """
    runs: dict[str, list[Chunk]] = {}
    order: list[list[Chunk]] = []
    for c in chunks:
        run = runs.get(c.request_id)
        if run is not None:
            last = run[-1]
            if (
                c.attempt == last.attempt
                and c.seq == last.end
                and last.finish_reason is None
                and c.error is None
                and c.prompt_logprobs is None
            ):
                run.append(c)
                continue
        runs[c.request_id] = run = [c]
        order.append(run)
    if len(order) == len(chunks):
        return chunks
    return [run[0] if len(run) == 1 else joined_chunk(run) for run in order]


class Outbox:
    """Queues chunks and acks for the producer; `run()` is the one sender."""

    def __init__(self, producer: AIOKafkaProducer, metrics: WorkerMetrics, linger_s: float = 0.0) -> None:
        self._producer = producer
        self._metrics = metrics
        self._linger_s = linger_s
        # Rung when something queued must not linger (a first token, a message to another worker).
        self._urgent = Doorbell()
        self._queue: asyncio.Queue[Outgoing | Reply] = asyncio.Queue()
        self._room = asyncio.Event()  # set while fewer than QUEUE_SIZE records wait
        self._room.set()
        self._resends: set[asyncio.Task[None]] = set()
        self._coalesce: Coalescer | None = None
        self._route: Callable[[str], str] | None = None
        # Told the topic and offset of every record the broker acknowledged (workers/reply_bells.py).
        self.on_acked: Callable[[str, int], None] | None = None

    @property
    def linger_s(self) -> float:
        """Least time between the starts of two rounds (0: none)."""
        return self._linger_s

    def coalesce_with(self, coalescer: Coalescer) -> None:
        """Pass every chunk through `coalescer` before it is queued."""
        self._coalesce = coalescer

    def route_with(self, route: Callable[[str], str]) -> None:
        """Send each record to `route(topic)`, resolved when it is handed to the producer (and again for a
        resend): a rolled topic's current epoch then, not the one current when the request was queued."""
        self._route = route

    def put(self, req: GenerateRequest, chunk: Chunk, urgent: bool = False) -> None:
        """Queue one chunk for the request's reply topic (never waits: its producer waits for `room()`);
        `urgent` sends it, and what waits with it, without lingering."""
        if self._coalesce is not None:
            merged = self._coalesce(req, chunk)
            if merged is None:
                return
            chunk = merged
        self._queue.put_nowait(Reply(req.reply_topic, chunk))
        if urgent:
            self._urgent.ring()

    async def room(self) -> None:
        """Wait while QUEUE_SIZE records are queued (Kafka lags): what produces chunks calls this between rounds."""
        while self._queue.qsize() >= QUEUE_SIZE:
            self._room.clear()
            await self._room.wait()

    def send_final_nowait(self, req: GenerateRequest, chunk: Chunk) -> None:
        """Queue a request's last chunk as it is, not coalesced: the word a task being cancelled leaves."""
        self._queue.put_nowait(Reply(req.reply_topic, chunk))

    def put_request(self, topic: str, release: Release, delivered: Callable[[], None] | None = None) -> None:
        """Queue a message for another worker's requests topic (a decode-first hand-off's release); `delivered`
        is called once the broker has it (to ring that worker's doorbell)."""
        out = Outgoing(topic, release.request_id.encode(), request_encoder.encode(release), delivered=delivered)
        self._queue.put_nowait(out)
        self._urgent.ring()

    async def send_ack(self, topic: str, ack: LoraAck) -> None:
        """Queue the answer to a LoRA operation for the asking frontend's admin topic."""
        await self._queue.put(Outgoing(topic, ack.op_id.encode(), request_encoder.encode(ack)))
        self._urgent.ring()

    async def run(self) -> None:
        """Hand queued records to the producer, in order, forever; rounds start `linger_s` apart at the closest."""
        queue = self._queue
        loop = asyncio.get_running_loop()
        last = -math.inf  # when the last round started
        while True:
            items = [await queue.get()]
            try:
                wait = last + self._linger_s - loop.time()
                if self._linger_s and wait > 0:
                    # The engine steps faster than this: what it makes meanwhile goes in the same records.
                    await self._urgent.wait(wait)
                last = loop.time()
                self._urgent.clear()
                while not queue.empty() and len(items) < QUEUE_SIZE:
                    items.append(queue.get_nowait())
                if queue.qsize() < QUEUE_SIZE:
                    self._room.set()
                for out in records(items):
                    await self._send(out)
            finally:
                for _ in items:
                    queue.task_done()

    async def _send(self, out: Outgoing) -> None:
        try:
            # Returns once the record is in the producer's batch; delivery is reported later.
            # Partition 0 is the only one a frontend reads (and spares hashing the key per record).
            topic = out.topic if self._route is None else self._route(out.topic)
            delivery = await self._producer.send(topic, out.value, key=out.key, partition=0)
            delivery.add_done_callback(functools.partial(self._on_delivery, out))
        except KafkaError as exc:
            self._on_send_error(out, exc)

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every record queued so far is acknowledged by the broker; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
                await self._producer.flush()
        except (TimeoutError, KafkaError):
            return False
        return True

    async def handed_over(self, timeout_s: float) -> None:
        """Wait (bounded) until every queued record is in the producer, whose stop() then flushes it."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
        except TimeoutError:
            log.warning(
                "%d reply record(s) still queued after %.0fs; dropping them", self._queue.qsize(), timeout_s
            )

    async def close(self) -> None:
        """Cancel resends still waiting: nothing sends them any more."""
        for t in self._resends:
            t.cancel()
        await asyncio.gather(*self._resends, return_exceptions=True)

    def _on_delivery(self, out: Outgoing, fut: asyncio.Future[RecordMetadata]) -> None:
        if fut.cancelled():
            return
        if fut.exception() is not None:
            self._on_send_error(out, fut.exception())
            return
        if self.on_acked is not None:
            meta = fut.result()
            self.on_acked(meta.topic, meta.offset)
        if out.delivered is not None:
            out.delivered()

    def _on_send_error(self, out: Outgoing, exc: BaseException | None) -> None:
        """Send a record again, behind whatever was queued since.

        The copy may land after later chunks of the same request: the frontend sees the gap, moves the
        sequence, and drops the copy (server/streams.py). A final chunk that follows nothing is saved.
        """
        self._metrics.kafka_send_errors.inc()
        if out.tries + 1 < SEND_TRIES:
            log.warning("a reply record was not delivered (%r); sending it again", exc)
            task = asyncio.create_task(self._resend(out._replace(tries=out.tries + 1)))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)
            return
        log.warning("a reply record was not delivered (%r); giving up on it", exc)

    async def _resend(self, out: Outgoing) -> None:
        # With fresh metadata (broker quirk "stale producer metadata").
        await self._producer.client.force_metadata_update()
        await self._queue.put(out)
