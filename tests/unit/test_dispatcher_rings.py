"""The dispatcher rings a worker's inbox for a request once the record is in the producer's batch, and once more
when the broker's acknowledgement came too late for the inbox that ring woke (server/dispatcher.py)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from aiokafka import AIOKafkaProducer

from kvstore.bells import Bells
from schemas.kafka import GenerateRequest
from server import dispatcher
from server.dispatcher import Dispatcher
from server.metrics import FrontendMetrics


class SlowBroker:
    """A producer whose broker acknowledges each record `ack_s` after it is handed over."""

    def __init__(self, ack_s: float, events: list[str]) -> None:
        self._ack_s = ack_s
        self._events = events

    async def send(self, topic: str, value: bytes, key: bytes, partition: int) -> asyncio.Future[Any]:
        delivery: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(self._ack_s, self._ack, delivery)
        return delivery

    def _ack(self, delivery: asyncio.Future[Any]) -> None:
        self._events.append("ack")
        delivery.set_result(_Meta())


class _Meta:
    offset = 7


class Rings:
    """Stands in for Bells: notes each ring among the broker's events."""

    def __init__(self, events: list[str]) -> None:
        self._events = events

    def ring_soon(self, worker_id: str) -> None:
        self._events.append(f"ring {worker_id}")


async def submit(ack_s: float) -> list[str]:
    events: list[str] = []
    d = Dispatcher(
        cast(AIOKafkaProducer, SlowBroker(ack_s, events)),
        5.0,
        FrontendMetrics(),
        bells=cast(Bells, Rings(events)),
    )
    request = GenerateRequest("r.0", "m", [1, 2, 3], 4, "replies")
    assert await d.submit("w1", request) == 7
    return events


async def test_the_ring_goes_out_before_the_acknowledgement() -> None:
    assert await submit(0.0) == ["ring w1", "ack"]


async def test_an_acknowledgement_later_than_half_the_inbox_linger_rings_again() -> None:
    assert await submit(dispatcher.LATE_ACK_S * 3) == ["ring w1", "ack", "ring w1"]
