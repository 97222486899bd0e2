"""Per-client-request mailboxes that the reply consumer fills and response handlers drain.

Which chunks count is a pure function of their order in the replies topic (one partition): a live
stream and a stream replayed from Kafka for a resuming client accept exactly the same chunks, so they
produce the same SSE events with the same ids. The frontend's own decisions that change what counts
(a sequence moving to another worker, a sequence it ends itself) are written into the topic too.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from schemas.kafka import ATTEMPT_LOST, ENGINE_DEAD, Chunk, ErrorInfo, GenerateRequest, KVFrom
from schemas.streams import ToolCallMode
from server.metrics import FrontendMetrics
from server.router import Decision

log = logging.getLogger("ferry.frontend")

# Sequence number of a migration marker: below every real chunk's, so it never becomes output.
MARKER_SEQ = -1


class Loss(Enum):
    """Why a sequence's attempt can no longer deliver its output (each is answered by moving it)."""

    WORKER_DIED = "its worker died"  # left the registry, or restarted under its id
    ENGINE_DIED = "its engine died"  # the worker's last word for it: the engine died with the sequence in it
    WORKER_STOPPED = "its worker stopped"  # the worker's last word for it: it stops on a fatal error
    LOG_LOST = "the broker lost the replies log"  # an empty restart: requests and chunks in transit are gone
    CHUNK_LOST = "a reply chunk never reached the topic"  # a gap in the attempt's chunks
    REQUEST_LOST = "its request got no answer"  # the delivery check: lost by the broker, or in doubt


class MoveState(Enum):
    """Where a sequence stands with respect to moving to another worker (server/migration.py)."""

    IN_PLACE = "in place"  # running on the worker its decision names
    MOVING = "moving"  # a move is under way: routing, its marker, its request, its first chunk
    MOVING_AGAIN = "moving again"  # lost again while moving: the move starts over as soon as it can


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
    # The attempt whose chunks count (0 = first worker; +1 per migration) and what it has produced.
    attempt: int = 0
    # The newest attempt a request went out for: ahead of `attempt` while a hand-off's marker is on its way.
    claimed: int = 0
    token_ids: list[int] = field(default_factory=list)
    switched: asyncio.Event = field(default_factory=asyncio.Event)
    progressed: asyncio.Event = field(default_factory=asyncio.Event)  # set on every chunk that counts
    # Set when a chunk of the current attempt went missing: nothing more of this attempt counts.
    broken: bool = False
    # Moves because a worker was lost (what --migration-limit bounds; a broker that lost its log or a
    # chunk is not the request's doing), and the worker to stop once the move in progress is in place.
    moves: int = 0
    moved_from: str = ""
    # How many tokens the sequence had when its current attempt began counting; the attempt its worker said it
    # could not finish (ATTEMPT_LOST), and that worker; the workers whose engine died in an attempt of it that
    # had produced nothing yet (server/losses.py).
    attempt_from: int = 0
    lost_attempt: int = -1
    lost_on: str = ""
    engine_deaths: list[str] = field(default_factory=list)
    stalls: int = 0  # moves made again because the broker lost their marker or request
    move: MoveState = MoveState.IN_PLACE  # changed only through server/migration.py's transitions
    move_reason: str = "worker_died"  # the Loss (lower-case name) that started the move under way
    wait_s: float = 0.0  # spent in the frontend before it was sent: routing and waiting for a non-busy worker
    # Disaggregated serving (server/disagg.py): the decode worker the sequence moves to once its prefill
    # worker's token arrived (charged load from the start; None once moved, or when not disaggregated), what it
    # is told of the prompt's KV, and how the sequence was placed ("off", "remote", "local").
    handoff: Decision | None = None
    kv_from: KVFrom | None = None
    placement: str = "off"
    decode_worker: str = ""
    # The decode attempt sent ahead to the `handoff` worker, parked there until the prefill worker releases it
    # (decode-first hand-off, workers/parking.py), and its offset in that worker's topic; None once handed off.
    parked: GenerateRequest | None = None
    parked_offset: int = -1
    # Whether the prefill worker's token waits for the decode worker's word before it reaches the client
    # (`--disagg-first-token decode`), and the token's chunk while it waits.
    hold_first: bool = False
    held: Chunk | None = None

    @property
    def worker_id(self) -> str:
        """The worker serving this sequence."""
        return self.decision.worker_id


@dataclass(frozen=True)
class StreamSpec:
    """What shapes a request's response besides its chunks."""

    n: int
    prompt_lens: list[int]
    include_usage: bool = False
    logprobs: bool = False
    prompt_texts: list[str] = field(default_factory=list)
    # Each prompt's first token: an echoed prompt's logprobs start with it (nothing precedes it to score it).
    first_tokens: list[int] = field(default_factory=list)
    continuous_usage: bool = False
    # Chat requests with tools: how the output becomes tool calls.
    tools: ToolCallMode | None = None


def marker(request_id: str, attempt: int, worker_id: str) -> Chunk:
    """The chunk that switches a sequence over to `attempt` (on `worker_id`)."""
    return Chunk(request_id, MARKER_SEQ, worker_id=worker_id, attempt=attempt)


@dataclass
class ClientStream:
    """Everything the workers send for one client request, in arrival order."""

    id: str
    sequences: dict[str, Sequence] = field(default_factory=dict)
    _items: deque[tuple[Sequence, Chunk]] = field(default_factory=deque)
    _ready: asyncio.Event = field(default_factory=asyncio.Event)
    # Called when a sequence's attempt can no longer deliver (its worker died, a chunk never arrived, ...);
    # set by the owning Generation to its mover (server/migration.py). Without it, such a sequence fails.
    on_lost: Callable[[Sequence, Loss], None] | None = None
    # Called with every chunk that counts, as it counts: what its arrival sets off (its worker's prefill done,
    # the hand-off to the decode worker) must not wait for its delivery, which a held chunk's does.
    on_counted: Callable[[Sequence, Chunk], None] | None = None

    def put(self, chunk: Chunk) -> None:
        """Accept one chunk from Kafka; duplicates and chunks of superseded attempts are dropped."""
        seq = self.sequences.get(chunk.request_id)
        if seq is None or seq.finished:
            return
        if seq.held is not None and chunk.seq != MARKER_SEQ:
            # The decode worker's copy of the token (sent as its engine starts the sequence), or whatever
            # came instead: a move's first chunk, an error. The token goes first.
            self._items.append((seq, seq.held))
            self._ready.set()
            seq.held = None
        if chunk.attempt != seq.attempt:
            if chunk.attempt < seq.attempt:
                return  # from a worker the sequence already moved away from
            # The first chunk of a newer attempt is its marker, written before the request was sent.
            seq.attempt = chunk.attempt
            seq.attempt_from = len(seq.token_ids)
            seq.broken = False
            seq.switched.set()
        if chunk.seq < seq.next_seq:
            return
        if chunk.error is not None and chunk.error.code in ATTEMPT_LOST and chunk.seq == seq.next_seq:
            # (After a gap it is a lost chunk's move, below: the tokens in the gap would not be counted.)
            self._attempt_lost(seq, chunk)
            return
        if seq.broken and not (chunk.seq == seq.next_seq and chunk.finish_reason == "error"):
            return  # only an error ending (the frontend's own, when the move fails) still counts
        if chunk.seq > seq.next_seq:
            # A chunk before this one never reached the topic (the worker's produce failed, e.g. while the
            # broker restarted): its tokens are gone, so the attempt cannot go on. Moving the sequence
            # re-sends the tokens that did arrive; a replay of the topic drops the same chunks.
            seq.broken = True
            if self.on_lost is not None:
                log.warning(
                    "%s: chunk %d of attempt %d arrived after chunk %d; moving the sequence",
                    seq.request_id,
                    chunk.seq,
                    seq.attempt,
                    seq.next_seq - 1,
                )
                self.on_lost(seq, Loss.CHUNK_LOST)
            return
        seq.next_seq = chunk.end
        seq.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            seq.finished = True
        seq.progressed.set()
        if self.on_counted is not None:
            self.on_counted(seq, chunk)
        if seq.hold_first and chunk.attempt == 0 and chunk.seq == 0 and chunk.finish_reason is None:
            seq.held = chunk  # a disaggregated sequence's prefill token: it counts, and waits (above)
            return
        self._items.append((seq, chunk))
        self._ready.set()

    def _attempt_lost(self, seq: Sequence, chunk: Chunk) -> None:
        """The worker's last word for an attempt it cannot finish: not the sequence's end. Nothing more of the
        attempt counts and the sequence moves, as when its worker dies (a replay skips the chunk alike)."""
        if seq.broken:
            return  # already moving (a chunk of the attempt went missing)
        seq.broken = True
        seq.lost_attempt, seq.lost_on = seq.attempt, chunk.worker_id
        assert chunk.error is not None
        if self.on_lost is not None:
            self.on_lost(seq, Loss.ENGINE_DIED if chunk.error.code == ENGINE_DEAD else Loss.WORKER_STOPPED)

    def ending(self, request_id: str, error: ErrorInfo) -> Chunk | None:
        """The chunk that ends one sequence with an error that did not come from its worker."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.finished:
            return None
        return Chunk(
            request_id,
            seq.next_seq,
            finish_reason="error",
            error=error,
            worker_id=seq.worker_id,
            attempt=seq.attempt,
        )

    def fail(self, request_id: str, error: ErrorInfo) -> None:
        """End one sequence with an error that did not come from its worker."""
        chunk = self.ending(request_id, error)
        if chunk is not None:
            self.put(chunk)

    @property
    def finished(self) -> bool:
        """True once every sequence has its final chunk (it may still be unread)."""
        return all(s.finished for s in self.sequences.values())

    @property
    def drained(self) -> bool:
        """True once every sequence ended and every chunk was read."""
        return self.finished and not self._items

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


class ChunkSource(Protocol):
    """What the response writers read: a live Generation, or a stream replayed from Kafka."""

    id: str
    created: int
    model: str

    @property
    def spec(self) -> StreamSpec:
        """What shapes the response besides the chunks."""
        ...

    @property
    def metrics(self) -> FrontendMetrics | None:
        """Where to count tokens; None for a replay (the live request counted them already)."""
        ...

    def chunks(self) -> AsyncIterator[list[tuple[Sequence, Chunk]]]:
        """Batches of accepted chunks; an empty batch means a keep-alive is due."""
        ...

    async def close(self) -> None:
        """The reader is done (finished, failed or gone)."""
