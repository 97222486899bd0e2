"""`ferry usage` reads the usage topic to its real end: a frontend's producer sends several records in one
batch, and the embedded broker's ListOffsets answer stops short of the end by the rest of the last batch."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import pytest
from aiokafka import AIOKafkaProducer

from bus.topics import ensure_topics
from launch.usage import read_usage, summarize
from schemas.names import usage_topic
from schemas.tenants import UsageRecord

pytestmark = pytest.mark.integration


async def test_records_sent_in_one_batch_are_all_read(kafka: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    await ensure_topics(kafka, {usage_topic(): 1})
    since = time.time() - 1
    producer = AIOKafkaProducer(bootstrap_servers=kafka, linger_ms=50)  # as the frontend's UsagePublisher
    await producer.start()
    try:
        records = [
            UsageRecord(at=time.time(), tenant=tenant, key_id="k", model="m", prompt_tokens=n) for n in (1, 2, 3, 4)
        ]
        sent = [await producer.send(usage_topic(), msgspec.json.encode(r), key=tenant.encode()) for r in records]
        await asyncio.gather(*sent)  # one batch: queued within one linger
    finally:
        await producer.stop()
    mine = [r for r in await read_usage(kafka, since) if r.tenant == tenant]
    assert summarize(mine, "tenant")[tenant]["prompt_tokens"] == 10, mine
