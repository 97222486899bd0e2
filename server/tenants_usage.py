"""Tenants' usage, one record per finished generation request, published to the usage topic.

Records are sent without waiting for the broker's ack (the response is over by then; a slow broker must not
hold anything up); a send that fails is logged and counted, and its usage is missing from `ferry usage`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from aiokafka import AIOKafkaProducer

from bus.topics import ensure_topics
from schemas.names import usage_topic
from schemas.tenants import UsageRecord
from server.metrics import FrontendMetrics
from server.tenants_quota import QuotaGate

log = logging.getLogger("ferry.tenants")
_encoder = msgspec.json.Encoder()


class UsagePublisher:
    """Publishes UsageRecords keyed by tenant (a tenant's records stay in order on one partition)."""

    def __init__(self, kafka: str, metrics: FrontendMetrics) -> None:
        self._kafka = kafka
        self._metrics = metrics
        # Batched: usage is not latency-sensitive.
        self._producer = AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=50, request_timeout_ms=10_000)
        self._pending: set[asyncio.Task[None]] = set()

    def publish(self, record: UsageRecord) -> None:
        """Queue one record for the usage topic."""
        task = asyncio.create_task(self._send(record))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _send(self, record: UsageRecord) -> None:
        try:
            await self._producer.send_and_wait(
                usage_topic(), _encoder.encode(record), key=record.tenant.encode()
            )
        except Exception as exc:
            self._metrics.kafka_errors.inc()
            log.warning("usage of tenant %s not published (%r)", record.tenant, exc)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[UsagePublisher]:
        """Start the producer; on exit, send what is queued (bounded) and stop."""
        await ensure_topics(self._kafka, {usage_topic(): 1})
        await self._producer.start()
        try:
            yield self
        finally:
            if self._pending:
                await asyncio.wait(list(self._pending), timeout=5)
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
