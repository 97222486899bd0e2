"""Whether a request the broker acknowledged is still in its worker's topic.

A broker can lose requests it had acknowledged (docs/architecture.md, broker quirk "lost again after a
restart"), and nothing else would ever answer such a request: its worker is alive. A sequence that heard
nothing for `--delivery-check-s` asks here (server/migration.py) and is sent again if the broker no longer
has its request. Asking the broker, not a timer, is what lets a long prefill on a busy worker wait as long
as it takes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from bus.read_spec import Options
from bus.reader import Reader
from schemas.kafka import GenerateRequest, request_decoder
from schemas.names import request_topic

log = logging.getLogger("ferry.frontend")

# One lookup waits this long for the broker's answer before it calls the answer unknown.
LOOKUP_TIMEOUT_S = 5.0


class RequestLog:
    """Looks records up by offset in workers' request topics, one lookup at a time."""

    def __init__(self, bootstrap: str) -> None:
        # No group, no commits, no loop: it only reads where asked (past the end is an error, not a reset).
        self._reader = Reader(
            "request lookups", bootstrap, request_decoder, Options(fetch_wait_ms=100, offset_reset="none")
        )
        # (worker id, request id) -> the topic the request was sent to; None once its worker read and deleted
        # it (rolled request topics, `Dispatcher.topic_of`). Unset: the worker's one topic.
        self.topic_of: Callable[[str, str], str | None] | None = None

    async def start(self) -> None:
        """Connect to the broker."""
        await self._reader.start()

    async def stop(self) -> None:
        """Disconnect."""
        await self._reader.stop()

    async def holds(self, worker_id: str, offset: int, request: GenerateRequest) -> bool | None:
        """True if the record at `offset` of the worker's topic is this attempt's request, False if the
        broker lost it (the log ends before it, or another record took its place), None if the broker did
        not answer."""
        if not self._reader.started:
            return None
        topic = (
            request_topic(worker_id)
            if self.topic_of is None
            else self.topic_of(worker_id, request.request_id)
        )
        if topic is None:
            return None  # read by its worker, so not lost by the broker before that
        tp = TopicPartition(topic, 0)
        try:
            found = await self._reader.read_at(tp, offset, LOOKUP_TIMEOUT_S)
        except (KafkaError, TimeoutError) as exc:
            log.warning("could not look up request %s in %s: %r", request.request_id, tp.topic, exc)
            return None
        # A Cancel carries the same key; another attempt of the request is not this one.
        return (
            isinstance(found, GenerateRequest)
            and found.request_id == request.request_id
            and found.attempt == request.attempt
        )
