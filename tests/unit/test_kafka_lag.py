"""The planner's Kafka lag reader leaves nothing open when the broker cannot be reached."""

from __future__ import annotations

import socket

import pytest
from aiokafka.errors import KafkaConnectionError

from planner.kafka_lag import KafkaLag


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_failed_start_closes_both_clients() -> None:
    lag = KafkaLag(f"127.0.0.1:{_closed_port()}")
    with pytest.raises(KafkaConnectionError):
        await lag.start()
    assert lag._offsets._closed  # aiokafka warns "Unclosed AIOKafkaConsumer" otherwise
