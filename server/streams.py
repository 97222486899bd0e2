"""Per-client-request mailboxes that the reply consumer fills and response handlers drain."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from schemas.kafka import Chunk, ErrorInfo
from server.router import Decision


@dataclass
class Sequence:
    """One GenerateRequest of a client request: a choice of one prompt."""

    request_id: str
    choice: int
    prompt_index: int
    decision: Decision
    prompt_len: int
    next_seq: int = 0
    finished: bool = False

    @property
    def worker_id(self) -> str:
        """The worker serving this sequence."""
        return self.decision.worker_id


@dataclass
class ClientStream:
    """Everything the workers send for one client request, in arrival order, merged when the reader lags."""

    id: str
    sequences: dict[str, Sequence] = field(default_factory=dict)
    _items: deque[tuple[Sequence, Chunk]] = field(default_factory=deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, chunk: Chunk) -> None:
        """Accept one chunk from Kafka; duplicates (already seen seq numbers) are dropped."""
        seq = self.sequences.get(chunk.request_id)
        if seq is None or seq.finished or chunk.seq < seq.next_seq:
            return
        seq.next_seq = chunk.seq + 1
        if chunk.finish_reason is not None:
            seq.finished = True
        self._items.append((seq, chunk))
        self._ready.set()

    def fail(self, request_id: str, error: ErrorInfo) -> None:
        """End one sequence with an error that did not come from its worker."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.finished:
            return
        self.put(Chunk(request_id, seq.next_seq, finish_reason="error", error=error, worker_id=seq.worker_id))

    @property
    def finished(self) -> bool:
        """True once every sequence has its final chunk (it may still be unread)."""
        return all(s.finished for s in self.sequences.values())

    def unfinished(self) -> list[Sequence]:
        """Sequences still running on a worker."""
        return [s for s in self.sequences.values() if not s.finished]

    async def get(self, wait_s: float | None) -> list[tuple[Sequence, Chunk]]:
        """Every chunk that has arrived, waiting up to `wait_s` for the first; [] if none came."""
        if not self._items:
            self._ready.clear()
            # asyncio.timeout, not wait_for: wait_for (3.11) can swallow a cancellation that races with
            # the event being set, which would keep a disconnected stream alive.
            try:
                async with asyncio.timeout(wait_s):
                    await self._ready.wait()
            except TimeoutError:
                return []
        items = list(self._items)
        self._items.clear()
        return items
