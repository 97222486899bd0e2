"""Kafka lag: records in a topic its consumer group has not committed yet (end offset - committed offset).

Two backlogs matter to the planner: each worker's `ferry.requests.<worker>` and its rolled epochs (routed,
not yet read: the worker is behind) and the model's `ferry.pool.<model>` and its rolled epochs (batch items
nobody has taken yet).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from bus.epochs import group_offsets
from schemas.names import pool_group, pool_pattern, request_epoch, request_topic

log = logging.getLogger("ferry.planner")


def worker_group(worker_id: str) -> str:
    """The consumer group a worker commits its requests topic under (workers/inbox.py)."""
    return f"ferry-worker-{worker_id}"


def is_request_topic_of(topic: str, worker_id: str) -> bool:
    """Whether `topic` carries requests to `worker_id`: its one topic, or one of its rolled epochs."""
    base = request_topic(worker_id)
    return topic == base or (topic.startswith(f"{base}.e") and request_epoch(topic) is not None)


class KafkaLag:
    """Reads end offsets and committed offsets; one admin and one group-less consumer, kept open."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap
        self._admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000)
        self._offsets = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)

    async def start(self) -> None:
        """Connect; on failure nothing is left open."""
        try:
            await self._admin.start()
            await self._offsets.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Disconnect (also what a failed start opened)."""
        with contextlib.suppress(KafkaError, OSError):
            await self._offsets.stop()
        with contextlib.suppress(KafkaError, OSError):
            await self._admin.close()

    async def _lag(self, group: str, tps: list[TopicPartition]) -> int:
        if not tps:
            return 0
        ends = await self._offsets.end_offsets(tps)
        committed = await self._admin.list_consumer_group_offsets(group, partitions=tps)
        total = 0
        for tp in tps:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else 0
            total += max(0, ends.get(tp, 0) - done)
        return total

    async def pool(self, model: str) -> tuple[int, int] | None:
        """(lag, committed total) of the model's pool topics (each epoch with `--pool-roll-s`); None if the
        broker did not answer. Deleted epochs drop out of the committed total (the planner's rate ignores
        a drop)."""
        try:
            offsets = await group_offsets(
                self._bootstrap, pool_group(model), re.compile(pool_pattern(model)).match
            )
        except (KafkaError, OSError) as exc:
            log.warning("planner: cannot read the pool topic's lag (%r)", exc)
            return None
        lag = sum(max(0, end - done) for done, end in offsets.values())
        return lag, sum(done for done, _ in offsets.values())

    async def workers(self, worker_ids: Sequence[str]) -> int | None:
        """Requests routed to these workers and not yet committed by them; None if the broker did not answer."""
        try:
            # With --request-roll-s a worker's requests are spread over epoch topics: count each one listed.
            listed = await self._offsets.topics()
            total = 0
            for wid in worker_ids:
                tps = [TopicPartition(t, 0) for t in listed if is_request_topic_of(t, wid)]
                total += await self._lag(worker_group(wid), tps)
        except (KafkaError, OSError) as exc:
            log.warning("planner: cannot read the workers' topic lag (%r)", exc)
            return None
        return total
