"""What a sequence's move (server/migration.py's `Mover`) needs of its request and of the frontend."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

from schemas.kafka import Chunk, GenerateRequest, KVFrom
from server.delivery import RequestLog
from server.dispatcher import Dispatcher
from server.metrics import FrontendMetrics
from server.pool import WorkerPool
from server.preprocess import Prepared
from server.router import Decision, PromptMemo, Router
from server.streams import ClientStream, Sequence

if TYPE_CHECKING:
    from server.losses import Migrations


class MovingRequest(Protocol):
    """What a mover needs of the request whose sequences it moves (server/generation.py's Generation)."""

    model: str
    prepared: Prepared
    reply_topic: str
    stream: ClientStream

    @property
    def closed(self) -> bool:
        """The reader is gone: nothing of this request may start any more."""
        ...

    def submitted(self, seq: Sequence) -> bool:
        """True while the sequence holds router load (routed and not released)."""
        ...

    async def choose(self, memo: PromptMemo) -> Decision:
        """A routing decision, waiting (bounded) while every worker is busy."""
        ...

    def request_for(
        self,
        seq: Sequence,
        generated: list[int] | None = None,
        kv_from: KVFrom | None = None,
        attempt: int | None = None,
    ) -> GenerateRequest:
        """The GenerateRequest of one sequence; with `generated`, of its next attempt (`attempt`)."""
        ...

    def discard_parked(self, seq: Sequence, worker_id: str) -> None:
        """Drop the decode attempt parked for `seq` on `worker_id`."""
        ...

    def fail(self, seq: Sequence, message: str, code: str = "worker_died", retriable: bool = True) -> None:
        """End a sequence with an error of the frontend's own."""
        ...

    def end(self, seq: Sequence, chunk: Chunk | None) -> None:
        """End a sequence with a chunk of the frontend's own."""
        ...

    def own(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run `coro` as a task of the request's (cancelled when it closes)."""
        ...


class Services(Protocol):
    """The frontend's parts a move uses."""

    pool: WorkerPool
    router: Router
    dispatcher: Dispatcher
    metrics: FrontendMetrics
    migrations: Migrations
    requests: RequestLog
    migration_limit: int
    busy_wait_s: float
    request_timeout_s: float
    delivery_check_s: float
