"""A worker's requests topic: requests in order, each (request id, attempt) served once, cancels, LoRA ops."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiokafka import TopicPartition

from bus.reader import Batch, Hooks, Options, Own, Poll, Reader
from schemas.kafka import (
    Cancel,
    EngineControl,
    GenerateRequest,
    LoadLora,
    RequestMessage,
    UnloadLora,
    request_decoder,
)
from schemas.settings import WorkerSettings
from workers.lora import LoraControl
from workers.metrics import WorkerMetrics
from workers.serving import Serving

log = logging.getLogger("ferry.worker")

# Routed requests remembered for deduplication: a redelivered one is not run (and answered) twice.
SEEN_REQUESTS = 65536


class Inbox:
    """Reads the worker's own topic and hands each message to serving or LoRA control."""

    def __init__(
        self,
        settings: WorkerSettings,
        topic: str,
        serving: Serving,
        lora: LoraControl,
        metrics: WorkerMetrics,
        on_fatal: Callable[[BaseException], None],
        on_log_lost: Callable[[], Awaitable[None]],
    ) -> None:
        self.topic = topic
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
            Hooks(self._handle, failed=on_fatal, reset=self._reset),
        )

    async def open(self) -> None:
        """Position on the topic (from the last commit) before the worker registers."""
        await self.reader.open(Own(self.topic))

    async def _handle(self, batch: Batch[RequestMessage]) -> None:
        for _record, msg in batch.messages:
            await self.dispatch(msg)

    async def _reset(self, rewound: list[TopicPartition]) -> None:
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
