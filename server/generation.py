"""One client request in flight: its sequences on workers, their chunks, and their cancellation."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from schemas.kafka import Chunk, ErrorInfo, GenerateRequest
from server.errors import APIError
from server.kafka_io import Dispatcher, ReplyDemux
from server.metrics import FrontendMetrics
from server.pool import WorkerPool
from server.preprocess import Prepared
from server.router import AllBusy, Decision, PromptMemo, Router
from server.streams import ClientStream, Sequence

log = logging.getLogger("ferry.frontend")


@dataclass
class Services:
    """What a generation needs from the running frontend."""

    frontend_id: str
    reply_topic: str
    pool: WorkerPool
    router: Router
    dispatcher: Dispatcher
    demux: ReplyDemux
    metrics: FrontendMetrics
    request_timeout_s: float
    keepalive_s: float
    busy_wait_s: float = 5.0


def new_id(prefix: str) -> str:
    """An OpenAI-looking id such as `chatcmpl-3f2a...`."""
    return f"{prefix}-{secrets.token_hex(12)}"


class Generation:
    """Fans a prepared request out to workers and yields their chunks until every sequence ends."""

    def __init__(self, svc: Services, model: str, prepared: Prepared, request_id: str) -> None:
        self.svc = svc
        self.model = model
        self.prepared = prepared
        self.id = request_id
        self.stream = ClientStream(request_id)
        self.created = int(time.time())
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._last_token_at = 0.0
        self.predicted_cached_blocks = 0
        self._submitted: list[Sequence] = []
        self._closed = False

    @property
    def worker_ids(self) -> list[str]:
        """Workers serving this request, in choice order, without repeats."""
        return list(dict.fromkeys(s.worker_id for s in self.stream.sequences.values()))

    async def start(self) -> None:
        """Route and submit every sequence; raises APIError (e.g. 503) before anything was streamed."""
        p = self.prepared
        router = self.svc.router
        try:
            for pi, ids in enumerate(p.prompts):
                memo = PromptMemo(ids)
                for c in range(p.n):
                    decision = await self._choose(memo)
                    router.started(decision)
                    rid = f"{self.id}.{pi * p.n + c}"
                    self.predicted_cached_blocks += decision.predicted_cached_blocks
                    self.stream.sequences[rid] = Sequence(rid, pi * p.n + c, pi, decision, len(ids))
                    self._submitted.append(self.stream.sequences[rid])
        except BaseException:
            for seq in self._submitted:
                router.finished(seq.decision)
            self._submitted.clear()
            raise
        self.svc.demux.register(self.stream)
        deadline = time.time() + self.svc.request_timeout_s
        try:
            for seq in self.stream.sequences.values():
                req = GenerateRequest(
                    request_id=seq.request_id,
                    model=self.model,
                    prompt_token_ids=p.prompts[seq.prompt_index],
                    max_tokens=p.max_tokens,
                    reply_topic=self.svc.reply_topic,
                    sampling=p.sampling,
                    index=seq.choice,
                    priority=p.priority,
                    deadline=deadline,
                    frontend_id=self.svc.frontend_id,
                )
                await self.svc.dispatcher.submit(seq.worker_id, req)
        except BaseException:
            await self.close()
            raise

    async def _choose(self, memo: PromptMemo) -> Decision:
        """A routing decision, waiting (bounded) while every worker is over a busy threshold."""
        pool, router, metrics = self.svc.pool, self.svc.router, self.svc.metrics
        deadline = time.monotonic() + self.svc.busy_wait_s
        waited = False
        while True:
            try:
                decision = await router.choose(self.model, pool.live(self.model), memo)
            except AllBusy:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not pool.try_enter_wait():
                    metrics.busy_waits.labels("refused").inc()
                    raise APIError(
                        503, "Every worker is busy; try again shortly.", code="workers_busy", retry_after=1
                    ) from None
                waited = True
                try:
                    await pool.wait_refreshed(remaining)
                finally:
                    pool.leave_wait()
                continue
            if waited:
                metrics.busy_waits.labels("served").inc()
            return decision

    async def chunks(self) -> AsyncIterator[list[tuple[Sequence, Chunk]]]:
        """Batches of chunks as they arrive; an empty batch means `keepalive_s` passed without any."""
        idle_since = time.monotonic()
        while not (self.stream.finished and not self.stream._items):
            batch = await self.stream.get(self.svc.keepalive_s)
            now = time.monotonic()
            if batch:
                idle_since = now
                if any(c.token_ids or c.text for _, c in batch):
                    t = time.perf_counter()
                    if self.first_token_at is None:
                        self.first_token_at = t
                        self.svc.metrics.ttft.observe(t - self.started_at)
                    else:
                        # Gap between deliveries of new tokens to this request (merged deltas count once).
                        self.svc.metrics.itl.observe(t - self._last_token_at)
                    self._last_token_at = t
                for seq, chunk in batch:
                    if chunk.token_ids and not seq.decision.prefilled:
                        self.svc.router.prefilled(seq.decision)
                    if chunk.finish_reason is not None:
                        self._release(seq)
            elif now - idle_since > self.svc.request_timeout_s:
                for seq in self.stream.unfinished():
                    self.stream.fail(
                        seq.request_id,
                        ErrorInfo("timeout", f"no progress from worker {seq.worker_id} for "
                                  f"{self.svc.request_timeout_s:.0f}s", retriable=True),
                    )
                continue
            yield batch

    def _release(self, seq: Sequence) -> None:
        if seq in self._submitted:
            self._submitted.remove(seq)
            self.svc.router.finished(seq.decision)

    async def close(self) -> None:
        """Cancel whatever is still running (client gone or error) and stop receiving chunks."""
        if self._closed:
            return
        self._closed = True
        self.svc.demux.unregister(self.stream)
        pending = list(self._submitted)
        for seq in pending:
            self._release(seq)
        if pending:
            log.debug("cancelling %d unfinished sequence(s) of %s", len(pending), self.id)
            await asyncio.shield(
                asyncio.gather(
                    *(self.svc.dispatcher.cancel(s.worker_id, s.request_id) for s in pending),
                    return_exceptions=True,
                )
            )


def error_status(error: ErrorInfo) -> APIError:
    """The HTTP error for a sequence that failed before anything was streamed."""
    if error.code == "context_length_exceeded":
        return APIError(400, error.message, code=error.code)
    if error.retriable:
        return APIError(503, error.message, code=error.code, retry_after=1)
    return APIError(500, error.message, code=error.code)
