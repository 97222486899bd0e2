"""bus.produce.send_and_wait: `on_sent` runs once the record is in the producer's batch, before the broker's
acknowledgement (a doorbell rung then crosses Redis while the record crosses the broker), and only once when the
broker's one-off UnknownError makes it send the record again."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownError

from bus.produce import send_and_wait


class _Client:
    async def force_metadata_update(self) -> bool:
        return True


class FakeProducer:
    """Records what happens in order; the broker's answer to each send is set by the test."""

    def __init__(self, answers: list[BaseException | None]) -> None:
        self.events: list[str] = []
        self.client = _Client()
        self._answers = answers
        self.pending: list[asyncio.Future[Any]] = []

    async def send(self, topic: str, value: bytes, key: bytes, partition: int) -> asyncio.Future[Any]:
        self.events.append("send")
        delivery: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(delivery)
        answer = self._answers.pop(0)
        loop = asyncio.get_running_loop()
        # The broker answers after the caller got the future back (as aiokafka's sender does).
        if answer is None:
            loop.call_soon(self._ack, delivery)
        else:
            loop.call_soon(delivery.set_exception, answer)
        return delivery

    def _ack(self, delivery: asyncio.Future[Any]) -> None:
        self.events.append("ack")
        delivery.set_result("metadata")


async def test_on_sent_comes_between_the_send_and_the_acknowledgement() -> None:
    producer = FakeProducer([None])
    got = await send_and_wait(
        cast(AIOKafkaProducer, producer), "t", b"v", b"k", on_sent=lambda: producer.events.append("on_sent")
    )
    assert got == "metadata"
    assert producer.events == ["send", "on_sent", "ack"]


async def test_a_record_sent_again_after_unknown_error_is_announced_once() -> None:
    producer = FakeProducer([UnknownError(), None])
    await send_and_wait(
        cast(AIOKafkaProducer, producer), "t", b"v", b"k", on_sent=lambda: producer.events.append("on_sent")
    )
    assert producer.events == ["send", "on_sent", "send", "ack"]
