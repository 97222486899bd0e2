"""The usage publisher reads its records back and sends again one the broker acknowledged and lost.

Real broker; the loss is the one the embedded broker shows under load (docs/architecture.md, broker quirk
"acked, then gone"): the ack names an offset that another record holds.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
import pytest

from launch.usage import read_usage, summarize
from schemas.tenants import UsageRecord
from server.metrics import FrontendMetrics
from server.tenants_usage import UsagePublisher
from tests.harness import until

pytestmark = pytest.mark.integration


async def test_a_record_acknowledged_and_lost_is_sent_again_and_counted_once(kafka: str) -> None:
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    metrics = FrontendMetrics()
    publisher = UsagePublisher(kafka, metrics)
    decode = msgspec.json.Decoder(UsageRecord).decode
    since = time.time() - 1
    lost: list[UsageRecord] = []
    async with publisher.running() as usage:
        send = usage._producer.send_and_wait

        async def loses_the_first(topic: str, value: bytes, **kw: Any) -> Any:
            record = decode(value)
            if record.prompt_tokens == 7 and not lost:
                lost.append(record)
                # Acknowledged at an offset that another record holds: this one is nowhere.
                other = msgspec.structs.replace(record, tenant="someone-else", id=uuid.uuid4().hex)
                return await send(topic, msgspec.json.encode(other), **kw)
            return await send(topic, value, **kw)

        usage._producer.send_and_wait = loses_the_first  # type: ignore[method-assign]
        usage.publish(UsageRecord(at=time.time(), tenant=tenant, key_id="k", model="m", prompt_tokens=7))
        usage.publish(UsageRecord(at=time.time(), tenant=tenant, key_id="k", model="m", prompt_tokens=5))

        async def all_read_back() -> bool:
            return usage.unseen == 0

        await until(all_read_back, 20)
    assert lost, "the first record was not sent"
    assert metrics.registry.get_sample_value("ferry_usage_records_resent_total") == 1
    records = [r for r in await read_usage(kafka, since) if r.tenant == tenant]
    assert sorted(r.prompt_tokens for r in records) == [5, 7]
    assert summarize(records, "tenant")[tenant]["prompt_tokens"] == 12
