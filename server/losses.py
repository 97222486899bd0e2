"""The frontend's policy for lost workers and lost logs, and for sequences whose engines keep dying.

Which sequences move when a worker is lost (server/migration.py's `Mover` moves each), what is logged and
counted. A request that kills the engine running it (a poison request: an engine bug that its prompt or its
sampling sets off) would be moved from worker to worker, taking each one down, up to --migration-limit times;
a sequence whose engine died twice while it had produced nothing in that attempt ends with an error instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaProducer

from bus.produce import refresh_metadata
from kvstore.kv_index import KVIndex
from schemas.kafka import ENGINE_DEATHS_LIMIT, ErrorInfo
from server.dispatcher import Dispatcher
from server.kafka_io import ReplyDemux
from server.metrics import FrontendMetrics
from server.router import Router
from server.streams import Loss, Sequence

log = logging.getLogger("ferry.frontend")


def engine_death(seq: Sequence) -> str | None:
    """Count the engine death that ended the sequence's attempt; the client's error if it must not move again."""
    if len(seq.token_ids) > seq.attempt_from:
        return None  # it was generating there: a bystander
    seq.engine_deaths.append(seq.lost_on)
    if len(seq.engine_deaths) < ENGINE_DEATHS_LIMIT:
        return None
    log.error(
        "%s: the engines of workers %s died while it was starting there; not moving it again",
        seq.request_id,
        ", ".join(seq.engine_deaths),
    )
    return (
        f"the engines of workers {', '.join(seq.engine_deaths)} died while starting this request; it is not "
        "retried, as it may be what kills them"
    )


class Migrations:
    """The frontend's policy for lost workers and lost logs: which sequences move, what is logged and counted."""

    def __init__(
        self,
        demux: ReplyDemux,
        dispatcher: Dispatcher,
        producer: AIOKafkaProducer,
        router: Router,
        index: KVIndex,
        metrics: FrontendMetrics,
        migration_limit: int,
        grace_s: float,
        spawn: Callable[[Awaitable[Any]], None],
    ) -> None:
        self._demux = demux
        self._dispatcher = dispatcher
        self._producer = producer
        self._router = router
        self._index = index
        self._metrics = metrics
        self._limit = migration_limit
        self._grace_s = grace_s
        self._spawn = spawn
        # Monotonic time the broker was last seen to have lost the replies log (REPLIES_IN_DOUBT_S).
        self.log_lost_at = -math.inf

    def worker_gone(self, worker_id: str, restarted: bool) -> None:
        """A worker left the registry (or restarted under its id): its open sequences move.

        A worker that drained cleanly left after its last chunks were acknowledged; the reply reader gets
        `grace_s` (one heartbeat) to deliver them before anything still open counts as lost.
        """
        asyncio.get_running_loop().call_later(self._grace_s, self._lose, worker_id)
        self._router.forget_worker(worker_id)
        if not restarted:  # a restarted worker swept its own entries and is publishing new ones
            self._spawn(self._index.clear_worker(worker_id))

    def log_lost(self) -> None:
        """The broker lost the replies log (an empty restart): every open sequence is sent again.

        The producer's metadata is refreshed too, or what it writes next may stay unseen for a while
        (docs/architecture.md, broker quirk "stale producer metadata"; moves have a watchdog).
        """
        self.log_lost_at = time.monotonic()
        self._lose(None)
        self._spawn(refresh_metadata(self._producer))

    def _lose(self, worker_id: str | None) -> None:
        what = f"worker {worker_id} stopped responding" if worker_id else "the message broker lost its log"
        why = Loss.WORKER_DIED if worker_id else Loss.LOG_LOST
        error = ErrorInfo("worker_died", what, retriable=True)
        # A sequence whose attempt the worker itself said it could not finish is moving already.
        lost = [
            (stream, seq)
            for stream, seq in self._demux.open_sequences(worker_id)
            if worker_id is None or (seq.lost_attempt, seq.lost_on) != (seq.attempt, worker_id)
        ]
        if not lost:
            return
        self._metrics.worker_failures.inc(len(lost))
        log.error(
            "%s with %d sequence(s) in flight; moving them (migration limit %d)", what, len(lost), self._limit
        )
        for stream, seq in lost:
            if stream.on_lost is not None:
                # A moving sequence sends the Cancel itself, once its old worker's late chunks no longer count.
                stream.on_lost(seq, why)
                continue
            stream.fail(seq.request_id, error)
            if worker_id is not None:
                # A worker that only missed heartbeats (a pause, a Redis hiccup) is still generating: stop it.
                self._spawn(self._dispatcher.cancel(worker_id, seq.request_id))
