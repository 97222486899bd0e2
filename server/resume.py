"""Resumable streams: reading a request's chunks back from Kafka (where they are: kvstore/resume_store.py).

A client that opted in (header `x-ferry-resumable: 1`) and lost its connection reconnects with
`GET /v1/chat/completions/{id}/stream` (or `/v1/completions/{id}/stream`) and `Last-Event-ID`. Any
frontend replica can answer: the record says which replies topic holds the chunks and from which
offset; the chunks are read again from there with the same acceptance rules as the live stream
(server/streams.py), so the rebuilt events carry the same ids, and those up to `Last-Event-ID` are
skipped. The reader then follows the topic live until the request ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from bus.read_spec import At, Batch, Hooks, Options, Poll
from bus.reader import Reader
from kvstore.resume_store import ResumeStore
from schemas.kafka import Chunk, ErrorInfo, ReplyMessage, chunks_of, reply_decoder
from schemas.streams import StreamRecord
from server.metrics import FrontendMetrics
from server.router import Decision
from server.streams import ClientStream, Sequence, StreamSpec

log = logging.getLogger("ferry.frontend")


def parse_last_event_id(value: str | None) -> int:
    """The id of the last event the client has; -1 when it has none (start from the first)."""
    if value is None or not value.strip():
        return -1
    try:
        return int(value.strip())
    except ValueError:
        return -2  # malformed: the caller answers 400


class Replay:
    """A request's chunks read back from its replies topic: a ChunkSource like a live Generation."""

    def __init__(
        self,
        request_id: str,
        record: StreamRecord,
        bootstrap: str,
        store: ResumeStore,
        keepalive_s: float,
        idle_timeout_s: float,
        grace_s: float,
        fetch_wait_ms: int = 5,
    ) -> None:
        self.id = request_id
        self.created = record.created
        self.model = record.model
        self.record = record
        self.spec = StreamSpec(
            n=record.n,
            prompt_lens=record.prompt_lens,
            include_usage=record.include_usage,
            logprobs=record.logprobs,
            prompt_texts=record.echo_texts,
            first_tokens=record.first_tokens,
            continuous_usage=record.continuous_usage,
            tools=record.tools,
        )
        self.metrics: FrontendMetrics | None = None
        self.stream = ClientStream(request_id)
        total = len(record.prompt_lens) * record.n
        for k in range(total):
            rid = f"{request_id}.{k}"
            self.stream.sequences[rid] = Sequence(
                rid, k, k // record.n, Decision(""), record.prompt_lens[k // record.n],
                hold_first=k in record.held_first,
            )  # fmt: skip
        self._store = store
        self._keepalive_s = keepalive_s
        self._idle_timeout_s = idle_timeout_s
        self._refresh_s = grace_s / 3
        # A resumed reader starts behind the log's end by definition: the Reader's fetch-wait stretch matters.
        self._reader = Reader(
            f"resume {request_id}",
            bootstrap,
            reply_decoder,
            Options(fetch_wait_ms=fetch_wait_ms, poll=Poll(1000, 2048)),
            Hooks(self._handle, failed=self._failed),
        )

    async def start(self) -> None:
        """Position at the request's first chunk and start reading."""
        await self._store.attach(self.id)
        await self._reader.start(At(self.record.topic, self.record.offset))

    async def _handle(self, batch: Batch[ReplyMessage]) -> None:
        for _record, message in batch.messages:
            for chunk in chunks_of(message):
                self.stream.put(chunk)

    def _failed(self, exc: BaseException) -> None:
        error = ErrorInfo("frontend_unavailable", f"resume reader failed: {exc!r}", retriable=True)
        for seq in self.stream.unfinished():
            self.stream.fail(seq.request_id, error)

    async def chunks(self) -> AsyncIterator[list[tuple[Sequence, Chunk]]]:
        """Accepted chunks in topic order; [] when `keepalive_s` passed without any."""
        idle_since = attached_at = pinged = time.monotonic()
        wait_s = max(0.001, min(self._keepalive_s, self._refresh_s))
        while not self.stream.drained:
            batch = await self.stream.get(wait_s)
            now = time.monotonic()
            if now - attached_at >= self._refresh_s:
                attached_at = now
                try:
                    await self._store.attach(self.id)
                except Exception as exc:
                    log.warning("could not mark the reader of %s attached: %r", self.id, exc)
            if batch:
                idle_since = pinged = now
                yield batch
            elif now - idle_since >= self._idle_timeout_s:
                for seq in self.stream.unfinished():
                    self.stream.fail(
                        seq.request_id,
                        ErrorInfo("timeout", f"no progress for {self._idle_timeout_s:.0f}s", retriable=True),
                    )
            elif now - pinged >= self._keepalive_s:
                pinged = now
                yield []

    async def close(self) -> None:
        """Stop reading."""
        await asyncio.shield(self._reader.stop())
