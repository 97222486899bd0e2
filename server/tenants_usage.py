"""Tenants' usage, one record per finished generation request, published to the usage topic.

Records are sent without waiting for the broker's ack (the response is over by then; a slow broker must not
hold anything up). Each carries an id of its own, and the publisher reads the topic back: a record that was
acknowledged but is not where the broker said (the embedded broker loses a few acknowledged records under
load, docs/architecture.md, broker quirk "acked, then gone") is sent again. `ferry usage` counts an id once,
so a record sent twice is never charged twice. A send that fails for good is logged and counted, and its usage
is missing from `ferry usage`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec
from aiokafka import AIOKafkaProducer, TopicPartition

from bus.read_spec import Batch, Hooks, Options, Poll, Tail
from bus.reader import Reader
from bus.topics import ensure_topics
from schemas.names import usage_topic
from schemas.tenants import UsageRecord
from server.metrics import FrontendMetrics
from server.tenants_quota import QuotaGate

log = logging.getLogger("ferry.tenants")
_encoder = msgspec.json.Encoder()

# How often one record is sent again when the topic does not hold it where the broker acknowledged it.
USAGE_SENDS = 3
# How long a stopping frontend waits for its last records to be read back (or found lost and sent again).
STOP_WAIT_S = 5.0


@dataclass(slots=True)
class _Unseen:
    """A record sent and not yet read back: its offset once acknowledged, and how often it was sent."""

    record: UsageRecord
    sends: int = 1
    offset: int | None = None


class UsagePublisher:
    """Publishes UsageRecords to partition 0 of the usage topic (one log: every record in order) and reads
    them back until each is seen where the broker acknowledged it."""

    def __init__(self, kafka: str, metrics: FrontendMetrics) -> None:
        self._kafka = kafka
        self._metrics = metrics
        # Batched: usage is not latency-sensitive.
        self._producer = AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=50, request_timeout_ms=10_000)
        self._pending: set[asyncio.Task[None]] = set()
        self._unseen: dict[str, _Unseen] = {}  # record id -> its delivery
        self._read_to = 0  # every record before this offset was read back
        self._all_seen = asyncio.Event()
        # A long fetch wait: the check is not in a hurry, and an idle reader costs the broker a fetch a wait.
        self._check = Reader(
            "usage check", kafka, msgspec.json.Decoder(UsageRecord),
            Options(fetch_wait_ms=500, poll=Poll(1000, 1024), watch_reset=True),
            Hooks(self._read_back, reset=self._log_lost, after_poll=self._send_lost),
        )  # fmt: skip

    @property
    def unseen(self) -> int:
        """Records sent and not yet read back."""
        return len(self._unseen)

    def publish(self, record: UsageRecord) -> None:
        """Queue one record for the usage topic."""
        if not record.id:
            record = msgspec.structs.replace(record, id=uuid.uuid4().hex)
        self._unseen[record.id] = _Unseen(record)
        self._all_seen.clear()
        self._send(record)

    def _send(self, record: UsageRecord) -> None:
        task = asyncio.create_task(self._send_one(record))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send_one(self, record: UsageRecord) -> None:
        try:
            meta = await self._producer.send_and_wait(usage_topic(), _encoder.encode(record), partition=0)
        except Exception as exc:
            self._forget(record.id)
            self._metrics.kafka_errors.inc()
            log.warning("usage of tenant %s not published (%r)", record.tenant, exc)
            return
        # Read back already (the reader can be ahead of the ack), or waiting for the reader to pass it.
        unseen = self._unseen.get(record.id)
        if unseen is not None:
            unseen.offset = meta.offset

    async def _read_back(self, batch: Batch[UsageRecord]) -> None:
        for _r, record in batch.messages:
            self._forget(record.id)
        self._read_to = batch.end

    def _forget(self, record_id: str) -> None:
        if self._unseen.pop(record_id, None) is not None and not self._unseen:
            self._all_seen.set()

    async def _log_lost(self, _rewound: list[TopicPartition]) -> None:
        # Read again from the start: records the lost log held are found missing as the reader passes them.
        self._read_to = 0

    async def _send_lost(self, _brought: bool) -> None:
        lost = [u for u in self._unseen.values() if u.offset is not None and u.offset < self._read_to]
        for u in lost:
            if u.sends >= USAGE_SENDS:
                self._forget(u.record.id)
                self._metrics.kafka_errors.inc()
                log.error(
                    "usage of tenant %s lost by the broker %d times; not sent again", u.record.tenant, u.sends
                )
                continue
            log.warning(
                "usage record of tenant %s acknowledged at offset %d is not on the topic; sending it again",
                u.record.tenant,
                u.offset,
            )
            self._metrics.usage_resent.inc()
            u.sends += 1
            u.offset = None
            self._send(u.record)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[UsagePublisher]:
        """Start the producer and the read-back; on exit, send what is queued (bounded) and stop."""
        await ensure_topics(self._kafka, {usage_topic(): 1})
        await self._producer.start()
        await self._check.start(Tail(usage_topic()))
        try:
            yield self
        finally:
            # Bounded: what is sent by then, and read back by then, is all a stopping frontend can vouch for.
            if self._unseen:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._all_seen.wait(), STOP_WAIT_S)
            await self._check.stop()
            await self._producer.stop()


def batch_charger(
    usage: UsagePublisher, quota: QuotaGate, metrics: FrontendMetrics
) -> Callable[[UsageRecord], Awaitable[None]]:
    """What a finished item of a tenant's batch does: its usage record, metrics, and its tokens charged to
    the tenant's tokens per minute and fair-share counter (never refused: the batch was accepted already)."""

    async def charge(record: UsageRecord) -> None:
        if record.tenant not in quota.tenants:
            log.warning(
                "batch usage of tenant %s, not in this frontend's tenants file: dropped", record.tenant
            )
            return
        usage.publish(record)
        metrics.tenant_tokens.labels(record.tenant, "prompt").inc(record.prompt_tokens)
        metrics.tenant_tokens.labels(record.tenant, "completion").inc(record.completion_tokens)
        metrics.tenant_requests.labels(record.tenant, "error" if record.errors else "ok").inc()
        await quota.charge(record.tenant, record.prompt_tokens + record.completion_tokens)

    return charge
