"""Producing: a send that survives the broker's one-off UnknownError; refreshing and pruning a producer's metadata."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import UnknownError
from aiokafka.structs import RecordMetadata


async def send_and_wait(
    producer: AIOKafkaProducer,
    topic: str,
    value: bytes,
    key: bytes,
    partition: int = 0,
    attempts: int = 3,
    on_sent: Callable[[], None] | None = None,
) -> RecordMetadata:
    """`producer.send_and_wait`, retrying the broker's UnknownError with fresh metadata; `on_sent` is called once
    the record is in the producer's batch, before the broker has acknowledged it.

    aiokafka calls UnknownError final, and the embedded broker answers it once for a topic that changed
    under the producer's metadata (docs/architecture.md, broker quirk "stale producer metadata").
    """
    for attempt in range(attempts):
        try:
            # What aiokafka's send_and_wait does, with the moment between its two awaits exposed.
            delivery = await producer.send(topic, value, key=key, partition=partition)
            if on_sent is not None and attempt == 0:
                on_sent()
            return await delivery
        except UnknownError:
            if attempt == attempts - 1:
                raise
            await producer.client.force_metadata_update()
    raise AssertionError("unreachable")


async def refresh_metadata(producer: AIOKafkaProducer, timeout_s: float = 5.0) -> None:
    """Fetch the producer's metadata anew (bounded); call when a reader found its log reset.

    Records written with stale metadata can be acknowledged and never seen (docs/architecture.md, broker
    quirk "stale producer metadata"); the frontend's delivery check is the safety net.
    """
    with contextlib.suppress(Exception):
        async with asyncio.timeout(timeout_s):
            await producer.client.force_metadata_update()


def forget_topics(producer: AIOKafkaProducer, stale: Callable[[str], bool]) -> None:
    """Stop tracking the metadata of the topics `stale` picks (deleted ones, or soon to be).

    aiokafka's client asks for the metadata of every topic its producer ever sent to, on every refresh and
    whenever it meets a new topic; the embedded broker creates a topic anew when a client asks for it by
    name, so a rolled topic deleted after use would come back, empty, for good (docs/architecture.md,
    broker quirk "metadata re-creates topics"), and every metadata request would grow with the topics
    rolled so far.
    """
    client = producer.client
    tracked: set[str] = client._topics
    drop = {t for t in tracked if stale(t)}
    if drop:
        # A non-empty subset triggers no metadata request (an empty set would mean "every topic").
        client.set_topics(tracked - drop)


# A topic not written for this long is no longer tracked (its next record tracks it again).
IDLE_TOPIC_S = 10.0


class TrackingProducer(AIOKafkaProducer):
    """An AIOKafkaProducer that knows when it last wrote to each topic, and forgets the idle ones.

    A process that writes to topics other processes roll and delete (a worker's replies, a frontend's
    requests) would otherwise ask for them again, and so re-create them on the embedded broker (see
    `forget_topics`). A topic with a record still on its way is never forgotten: aiokafka's next metadata
    update would leave its partition without a leader, and the record would wait for one until it expired.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last_write: dict[str, float] = {}
        self._pending: Counter[str] = Counter()  # records handed over and not yet acknowledged, per topic

    async def send(self, topic: str, *args: Any, **kwargs: Any) -> Any:
        """`AIOKafkaProducer.send`, noting the time and the record until it is acknowledged (or failed)."""
        self.last_write[topic] = time.monotonic()
        self._pending[topic] += 1
        try:
            delivery = await super().send(topic, *args, **kwargs)
        except BaseException:
            self._settled(topic)
            raise
        delivery.add_done_callback(lambda _fut: self._settled(topic))
        return delivery

    def _settled(self, topic: str) -> None:
        self._pending[topic] -= 1
        if self._pending[topic] <= 0:
            del self._pending[topic]

    def forget_idle(self, idle_s: float = IDLE_TOPIC_S, also: Callable[[str], bool] | None = None) -> None:
        """Stop tracking the topics not written for `idle_s` (and those `also` picks), unless a record to
        them is still on its way."""
        now = time.monotonic()
        self.last_write = {t: at for t, at in self.last_write.items() if now - at < idle_s}
        pending = self._pending
        forget_topics(
            self, lambda t: t not in pending and (t not in self.last_write or (also is not None and also(t)))
        )

    async def forget_idle_forever(self, idle_s: float = IDLE_TOPIC_S) -> None:
        """`forget_idle` every `idle_s` / 2 seconds, for the producer's life."""
        while True:
            await asyncio.sleep(idle_s / 2)
            self.forget_idle(idle_s)
