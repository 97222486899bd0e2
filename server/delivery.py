"""Whether a request the broker acknowledged is still in its worker's topic.

A broker that keeps its log in memory (Tansu) and restarts empty loses requests it had acknowledged; one
written just before or during the restart may be gone before its worker read it. Nothing else would ever
answer such a request: its worker is alive, so no heartbeat goes missing, and the replies topic's reset
is only seen by a reader whose position passes the new end. A generation that heard nothing of a sequence
for `--delivery-check-s` asks here, and sends the request again if the broker no longer has it. Asking the
broker, not a timer, is what lets a long prefill on a busy worker wait as long as it takes.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from bus.consumer import stop_consumer
from schemas.kafka import GenerateRequest, request_decoder
from schemas.names import request_topic

log = logging.getLogger("ferry.frontend")

# One lookup waits this long for the broker's answer before it calls the answer unknown.
LOOKUP_TIMEOUT_S = 5.0


class RequestLog:
    """Looks records up by offset in workers' request topics, one lookup at a time."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap
        self._consumer: AIOKafkaConsumer | None = None
        # One consumer serves every lookup: each one re-assigns it to the partition it reads.
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Connect to the broker (no group, no commits: it only reads)."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self._bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="none",
            fetch_max_wait_ms=100,
        )
        await consumer.start()
        self._consumer = consumer

    async def stop(self) -> None:
        """Disconnect."""
        if self._consumer is not None:
            await stop_consumer(self._consumer)
            self._consumer = None

    async def holds(self, worker_id: str, offset: int, request: GenerateRequest) -> bool | None:
        """True if the record at `offset` of the worker's topic is this attempt's request, False if the
        broker lost it (the log ends before it, or another record took its place), None if the broker did
        not answer."""
        consumer = self._consumer
        if consumer is None:
            return None
        tp = TopicPartition(request_topic(worker_id), 0)
        async with self._lock:
            try:
                consumer.assign([tp])
                consumer.seek(tp, offset)
                async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                    while True:
                        batch = await consumer.getmany(tp, timeout_ms=500, max_records=1)
                        records = batch.get(tp, [])
                        if records:
                            return records[0].offset == offset and _same(records[0].value, request)
                        # An empty fetch with the log's end at or before the offset: the record is gone.
                        # (Tansu answers a fetch past the end with an empty batch, not an error.)
                        end = consumer.highwater(tp)
                        if end is not None and end <= offset:
                            return False
            except OffsetOutOfRangeError:
                return False
            except (KafkaError, TimeoutError) as exc:
                log.warning("could not look up request %s in %s: %r", request.request_id, tp.topic, exc)
                return None
            finally:
                # Unassigned, the consumer stops fetching in the background until the next lookup.
                consumer.unsubscribe()


def _same(value: bytes | None, request: GenerateRequest) -> bool:
    """Whether a record's value is this attempt of this request (a Cancel carries the same key)."""
    try:
        found = request_decoder.decode(value or b"")
    except msgspec.DecodeError:
        return False
    return (
        isinstance(found, GenerateRequest)
        and found.request_id == request.request_id
        and found.attempt == request.attempt
    )
