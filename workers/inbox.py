"""A worker's requests topic: requests in order, each (request id, attempt) served once, cancels, LoRA ops."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from bus.log_watch import positions_and_ends
from bus.reader import Batch, Hooks, Options, Own, Poll, Reader
from bus.topics import RequestTopics, delete_topics, ensure_topics, retention
from schemas.kafka import (
    Cancel,
    EngineControl,
    GenerateRequest,
    LoadLora,
    RequestMessage,
    UnloadLora,
    request_decoder,
)
from schemas.names import request_topic
from schemas.settings import WorkerSettings
from workers.lora import LoraControl
from workers.metrics import WorkerMetrics
from workers.serving import Serving

log = logging.getLogger("ferry.worker")

# Routed requests remembered for deduplication: a redelivered one is not run (and answered) twice.
SEEN_REQUESTS = 65536


class Inbox:
    """Reads the worker's own topics and hands each message to serving or LoRA control.

    With `--request-roll-s`, frontends write to the topic of the current epoch of the clock (`RequestTopics`):
    the inbox reads a window of epochs plus the unrolled `ferry.requests.<worker>` (LoRA control, producers
    that do not roll) and deletes each topic that fell behind the window once it has read and committed all
    of it, so no partition grows for the worker's life (docs/architecture.md, broker quirk "slow long
    partitions").
    """

    def __init__(
        self,
        settings: WorkerSettings,
        serving: Serving,
        lora: LoraControl,
        metrics: WorkerMetrics,
        on_fatal: Callable[[BaseException], None],
        on_log_lost: Callable[[], Awaitable[None]],
    ) -> None:
        self.topic = request_topic(settings.worker_id)
        self._kafka = settings.kafka
        self._worker_id = settings.worker_id
        self.topics = RequestTopics(settings.request_roll_s)
        self._configs = retention(settings.kafka_request_retention_s, settings.kafka_retention_bytes)
        self._window: list[str] = []  # the rolled topics assigned now, oldest first
        self._ahead = ""  # the next epoch's topic, once created
        self._serving = serving
        self._lora = lora
        self._metrics = metrics
        self._on_log_lost = on_log_lost
        # (request id, attempt) of routed requests started lately, oldest first (bounded).
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.reader: Reader[RequestMessage] = Reader(
            "requests",
            settings.kafka,
            request_decoder,
            Options(
                fetch_wait_ms=settings.kafka_fetch_wait_ms,
                poll=Poll(1000, 256),
                # An idle worker sees nothing fail while the broker is away (no commit, no reply), so the
                # check cannot wait for an error: a position past the fetch's high watermark is the only sign
                # that the broker came back without this log, and on a healthy log it never holds.
                watch_reset=True,
                # Commit once the engine holds the requests: a restart under the same id resumes after them.
                commit_after_poll=True,
                group_id=f"ferry-worker-{settings.worker_id}",
                offset_reset="earliest",
            ),
            Hooks(self._handle, failed=on_fatal, reset=self._reset, after_poll=self._roll),
        )

    async def open(self) -> None:
        """Create and position on the topics (from the last commits) before the worker registers."""
        await ensure_topics(self._kafka, {self.topic: 1}, self._configs)
        await self.reader.open(Own(self.topic))
        await self._roll(False)

    async def _roll(self, got_records: bool) -> None:
        """Read the current window of rolled topics; delete those behind it once read (after every poll)."""
        if self.topics.roll_s <= 0:
            return
        window = self.topics.window(self._worker_id)
        ahead = self.topics.ahead(self._worker_id)
        if ahead != self._ahead:
            # Created an epoch early, so frontends never create it at the same moment as the worker (two
            # CreateTopics racing on the embedded broker can lose what was written in between).
            await ensure_topics(self._kafka, {ahead: 1}, self._configs)
            self._ahead = ahead
        new = [t for t in window if t not in self._window]
        behind = [t for t in self._window if self.topics.deletable(t)]
        if not new and not behind:
            return
        if new:
            await ensure_topics(self._kafka, dict.fromkeys(new, 1), self._configs)
        consumer = self.reader.consumer
        paused = consumer.paused()
        ends = {tp.topic: (position, end) for tp, position, end in await positions_and_ends(consumer)}
        # A topic behind the window goes once everything in it was read (and so committed: the reader
        # commits after every poll that brought records); one never fetched yet, or paused (its end is
        # not fetched), is read first.
        done = [
            t for t in behind if t in ends and ends[t][0] >= ends[t][1] and TopicPartition(t, 0) not in paused
        ]
        if not new and not done:
            return
        keep = [t for t in self._window if t not in done]
        positions = {}
        for tp in consumer.assignment():
            if tp.topic not in done:
                positions[tp] = await consumer.position(tp)
        # assign() forgets positions: the kept ones are put back, new ones start at the group's commit
        # (none yet: the start of the topic).
        consumer.assign(list({*positions, *(TopicPartition(t, 0) for t in new)}))
        for tp, offset in positions.items():
            consumer.seek(tp, offset)
        consumer.pause(*paused)  # assign() resumes them
        self._window = [*keep, *new]
        if done:
            try:
                await delete_topics(self._kafka, done)
            except KafkaError as exc:
                log.warning("could not delete read request topics %s: %r", done, exc)
            else:
                log.info("requests: deleted read topics %s", done)

    async def _handle(self, batch: Batch[RequestMessage]) -> None:
        for _record, msg in batch.messages:
            await self.dispatch(msg)

    async def _reset(self, rewound: list[TopicPartition]) -> None:
        self._window = []  # the broker lost the topics too: create the window again
        await self._on_log_lost()

    async def dispatch(self, msg: RequestMessage) -> None:
        """Act on one message of the topic."""
        match msg:
            case GenerateRequest():
                key = (msg.request_id, msg.attempt)
                if key in self._seen:
                    # Redelivered (a producer retry, a re-read after a restart): already running or done.
                    self._metrics.requests.labels("duplicate").inc()
                    return
                if msg.request_id in self._serving:
                    await self._serving.supersede(msg)
                if msg.deadline and msg.deadline < time.time():
                    log.info("request %s arrived after its deadline; skipped", msg.request_id)
                    self._metrics.requests.labels("expired").inc()
                    return
                self._seen[key] = None
                if len(self._seen) > SEEN_REQUESTS:
                    self._seen.popitem(last=False)
                self._serving.start(msg)
            case Cancel():
                await self._serving.cancel(msg.request_id)
            case LoadLora() | UnloadLora() | EngineControl():
                self._lora.submit(msg)
