"""One client request in flight: its sequences on workers, their chunks, and their cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstore.resume_store import ResumeStore
from schemas.kafka import Chunk, ErrorInfo, GenerateRequest, KVFrom
from server.delivery import RequestLog
from server.disagg import Placement, place, serving
from server.dispatcher import Dispatcher
from server.errors import APIError
from server.kafka_io import ReplyDemux
from server.losses import Migrations
from server.metrics import FrontendMetrics, observe_times
from server.migration import Mover
from server.pool import WorkerPool
from server.preprocess import Prepared
from server.router import AllBusy, Decision, PromptMemo, Router
from server.streams import ClientStream, Sequence, StreamSpec

log = logging.getLogger("ferry.frontend")

T = TypeVar("T")


@dataclass
class Services:
    """What a generation needs from the running frontend."""

    frontend_id: str
    pool: WorkerPool
    router: Router
    dispatcher: Dispatcher
    demux: ReplyDemux
    metrics: FrontendMetrics
    migrations: Migrations
    # Where a request with no answer after `delivery_check_s` is looked up (server/delivery.py).
    requests: RequestLog
    # Resumable streams: where their records live (kvstore/resume_store.py).
    resume: ResumeStore
    request_timeout_s: float
    keepalive_s: float
    busy_wait_s: float
    migration_limit: int
    delivery_check_s: float
    # How long a resumable stream whose client left runs unattended.
    resume_grace_s: float
    # Work that outlives a request's reader: generations whose client left but which keep running for a
    # resumed reader, and cancels on their way to workers. Cancelled at shutdown.
    detached: set[asyncio.Task[None]] = field(default_factory=set)


def new_id(prefix: str) -> str:
    """An OpenAI-looking id such as `chatcmpl-3f2a...`."""
    return f"{prefix}-{secrets.token_hex(12)}"


class Generation:
    """Fans a prepared request out to workers and yields their chunks until every sequence ends.

    A sequence whose worker dies moves to another worker (up to `migration_limit` times) with the
    tokens it already produced, and its chunks continue where they stopped. A resumable generation
    whose client leaves keeps running unattended (see `close`).
    """

    def __init__(
        self,
        svc: Services,
        model: str,
        prepared: Prepared,
        request_id: str,
        resumable: bool = False,
        arrived: float | None = None,
    ) -> None:
        self.svc = svc
        self.model = model
        self.prepared = prepared
        self.id = request_id
        self.resumable = resumable
        self.mover = Mover(self, svc)
        # Weakly, as the Mover holds it: a stream holding its request would make every request a cycle.
        self.stream = ClientStream(request_id, on_lost=self.mover.lost, on_counted=_weakly(self._arrived))
        self.created = int(time.time())
        # When the request arrived (perf_counter): what TTFT and end-to-end latency count from.
        self.started_at = time.perf_counter() if arrived is None else arrived
        self._m = svc.metrics.for_model(model)  # bound once: observed per token
        self.first_token_at: float | None = None
        self._last_token_at = 0.0
        self.predicted_cached_blocks = 0
        # Cached prompt tokens by prompt, from the final usages (a prompt's most among its choices, as the
        # response's usage counts them): the tenant's usage record carries their sum.
        self.cached_by_prompt: dict[int, int] = {}
        # Where this request's chunks arrive (set by start): its replies topic, and an offset at or before
        # the first of them (for a resume record).
        self.reply_topic = ""
        self.first_offset = 0
        self.deadline = 0.0
        self._submitted: list[Sequence] = []
        self._closed = False
        self._detached = False
        self._failed = False
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def spec(self) -> StreamSpec:
        """What shapes the response besides the chunks."""
        p = self.prepared
        return StreamSpec(
            n=p.n,
            prompt_lens=[len(x) for x in p.prompts],
            include_usage=p.include_usage,
            logprobs=p.sampling.logprobs is not None,
            prompt_texts=p.prompt_texts,
            first_tokens=[x[0] for x in p.prompts],
            continuous_usage=p.continuous_usage,
            tools=p.tools,
        )

    @property
    def metrics(self) -> FrontendMetrics:
        """Where this request's tokens are counted."""
        return self.svc.metrics

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
                memo = PromptMemo(ids, max_tokens=p.max_tokens, overtake=p.overtake)
                for c in range(p.n):
                    t0 = time.perf_counter()
                    placed = await self.place(memo)
                    decision = placed.first
                    decision.remaining = p.max_tokens
                    router.started(decision)
                    if placed.decode is not None:
                        router.started(placed.decode)  # reserved now, so concurrent requests see it
                    rid = f"{self.id}.{pi * p.n + c}"
                    self.predicted_cached_blocks += decision.predicted_cached_blocks
                    self.stream.sequences[rid] = seq = Sequence(rid, pi * p.n + c, pi, decision, len(ids),
                                                                wait_s=time.perf_counter() - t0)  # fmt: skip
                    seq.handoff, seq.kv_from, seq.placement = placed.decode, placed.kv_from, placed.mode
                    seq.hold_first = placed.mode == "remote" and router.config.disagg_first_token == "decode"
                    seq.decode_worker = (placed.decode or decision).worker_id
                    self._submitted.append(seq)
        except BaseException:
            for seq in list(self._submitted):
                self._release(seq)
            raise
        self.reply_topic, self.first_offset = self.svc.demux.register(self.stream, self.resumable)
        self.deadline = time.time() + self.svc.request_timeout_s
        try:
            for seq in self.stream.sequences.values():
                request = self.request_for(seq)
                offset = await self.svc.dispatcher.submit(seq.worker_id, request)
                self.mover.watch(seq, request, offset)
                if seq.handoff is not None and seq.kv_from is not None:
                    # Decode-first: the decode attempt waits parked on its worker for the prefill worker's
                    # Release, so the hand-off skips this frontend (server/migration.py, Mover._hand_over).
                    parked = self.request_for(seq, [], seq.kv_from, attempt=1, parked=True)
                    seq.claimed = 1
                    seq.parked = parked
                    seq.parked_offset = await self.svc.dispatcher.submit(seq.handoff.worker_id, parked)
        except BaseException:
            self.resumable = False
            await self.close()
            raise

    @property
    def failed(self) -> bool:
        """A sequence ended with an error (counted in the error metric when it arrived)."""
        return self._failed

    @property
    def closed(self) -> bool:
        """The reader is gone: nothing of this request may start any more."""
        return self._closed

    def submitted(self, seq: Sequence) -> bool:
        """True while the sequence holds router load (routed and not released)."""
        return seq in self._submitted

    def own(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run `coro` as a task of this request's (cancelled when it closes)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        # A bound method: the task keeps this request alive until it is done (its Mover holds the request
        # weakly), so a task cancelled by close() still finds it while it winds down.
        task.add_done_callback(self._forget_task)

    def _forget_task(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)

    def request_for(
        self,
        seq: Sequence,
        generated: list[int] | None = None,
        kv_from: KVFrom | None = None,
        attempt: int | None = None,
        parked: bool = False,
    ) -> GenerateRequest:
        """The GenerateRequest of one sequence; with `generated`, of its next attempt, `attempt` (`kv_from`: the
        attempt that continues a prefill worker's; `parked`: one that waits for its release). A first attempt bound
        for a prefill worker asks for one token, and releases the decode attempt parked for it."""
        p = self.prepared
        prior = generated or []
        prefill_only = generated is None and seq.handoff is not None
        return GenerateRequest(
            request_id=seq.request_id,
            model=self.model,
            prompt_token_ids=p.prompts[seq.prompt_index],
            max_tokens=1 if prefill_only else p.max_tokens - len(prior),
            reply_topic=self.reply_topic,
            sampling=p.sampling,
            index=seq.choice,
            priority=p.priority,
            deadline=self.deadline,
            generated_token_ids=prior,
            attempt=seq.attempt if attempt is None else attempt,
            frontend_id=self.svc.frontend_id,
            seq_base=seq.next_seq,
            prefill_only=prefill_only,
            kv_from=kv_from,
            release_to=seq.handoff.worker_id if prefill_only and seq.handoff is not None else "",
            parked=parked,
        )

    async def choose(self, memo: PromptMemo) -> Decision:
        """A routing decision among the workers that serve whole sequences, waiting (bounded) while every
        worker is over a busy threshold."""
        pool, router = self.svc.pool, self.svc.router
        return await self._when_free(lambda: router.choose(self.model, serving(pool.live(self.model)), memo))

    async def place(self, memo: PromptMemo) -> Placement:
        """A new sequence's worker(s), prefill and decode when disaggregated (server/disagg.py); waits as choose."""
        pool, router = self.svc.pool, self.svc.router
        return await self._when_free(lambda: place(router, self.model, pool.live(self.model), memo))

    async def _when_free(self, attempt: Callable[[], Awaitable[T]]) -> T:
        pool, metrics = self.svc.pool, self.svc.metrics
        deadline = time.monotonic() + self.svc.busy_wait_s
        waited = False
        while True:
            try:
                decision = await attempt()
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

    async def chunks(self, idle_s: float | None = None) -> AsyncGenerator[list[tuple[Sequence, Chunk]], None]:
        """Batches of chunks as they arrive; an empty batch means `idle_s` (the keep-alive) passed."""
        wait_s = self.svc.keepalive_s if idle_s is None else idle_s
        idle_since = time.monotonic()
        while not self.stream.drained:
            # Woken at the no-progress deadline too, not only at the keep-alive (which may be far later).
            until_deadline = idle_since + self.svc.request_timeout_s - time.monotonic()
            batch = await self.stream.get(max(min(wait_s, until_deadline), 0.001))
            now = time.monotonic()
            if batch:
                idle_since = now
                self._observe_tokens(batch)
                for seq, chunk in batch:
                    seq.decision.remaining -= len(chunk.token_ids)
                    if chunk.error is not None:
                        self._failed = True
                        self.svc.metrics.errors.labels(self.model, chunk.error.code, "stream").inc()
                    if chunk.usage is not None:
                        self._observe_usage(seq, chunk)
                    if chunk.finish_reason is not None:
                        self._release(seq)
            elif now - idle_since >= self.svc.request_timeout_s:
                for seq in self.stream.unfinished():
                    wait = self.svc.request_timeout_s
                    self.fail(seq, f"no progress from worker {seq.worker_id} for {wait:.0f}s", "timeout")
                continue
            yield batch

    def _arrived(self, seq: Sequence, chunk: Chunk) -> None:
        """What a chunk with tokens sets off when it counts: its worker's prefill is done; a prefill worker's
        token hands the sequence on to its decode worker."""
        if chunk.token_ids and not seq.decision.prefilled:
            self.svc.router.prefilled(seq.decision)
        if chunk.token_ids and seq.handoff is not None and chunk.finish_reason is None:
            self.mover.hand_off(seq)  # the prefill worker's token: on to the decode worker

    def _observe_tokens(self, batch: list[tuple[Sequence, Chunk]]) -> None:
        """TTFT on the first delivery with output; after it, inter-token latency once per token."""
        n = 0
        for _, c in batch:
            if c.token_ids or c.text:
                n += max(len(c.token_ids), 1)
        if not n:
            return
        t = time.perf_counter()
        if self.first_token_at is None:
            self.first_token_at = t
            self._m.ttft.observe(t - self.started_at)
            n -= 1  # the first token has no gap before it; any others delivered with it, none either
            self._last_token_at = t
        if n:
            # k tokens delivered together after a gap g: each token took g/k (merged deltas stay counted).
            observe_times(self._m.itl, (t - self._last_token_at) / n, n)
        self._last_token_at = t

    def _observe_usage(self, seq: Sequence, chunk: Chunk) -> None:
        """A sequence's final figures: queue (frontend wait + engine queue), prefill, decode, lengths."""
        u = chunk.usage
        assert u is not None
        m = self._m
        if chunk.error is None and chunk.finish_reason != "abort":
            m.queue.observe(seq.wait_s + u.queue_s)
            m.prefill.observe(u.prefill_s)
            m.decode.observe(u.decode_s)
        m.prompt_len.observe(u.prompt_tokens)
        m.completion_len.observe(u.completion_tokens)
        known = self.cached_by_prompt.get(seq.prompt_index, 0)
        self.cached_by_prompt[seq.prompt_index] = max(known, u.cached_tokens)

    def _release(self, seq: Sequence) -> None:
        if seq in self._submitted:
            self._submitted.remove(seq)
            self.svc.router.finished(seq.decision)
            if seq.handoff is not None:  # ended before it reached its decode worker
                self.svc.router.finished(seq.handoff)
                self.discard_parked(seq, seq.handoff.worker_id)
                seq.handoff = None

    def discard_parked(self, seq: Sequence, worker_id: str) -> None:
        """Drop the decode attempt parked for `seq` on `worker_id` (a Cancel of that attempt only: the sequence
        may move to that same worker as a newer attempt)."""
        parked, seq.parked = seq.parked, None
        if parked is None:
            return
        self._detach(self.svc.dispatcher.cancel(worker_id, seq.request_id, parked.attempt))

    def fail(self, seq: Sequence, message: str, code: str = "worker_died", retriable: bool = True) -> None:
        """End a sequence with an error of the frontend's own, and stop its worker on it."""
        worker_id = seq.worker_id
        self.end(seq, self.stream.ending(seq.request_id, ErrorInfo(code, message, retriable)))
        self._detach(self.svc.dispatcher.cancel(worker_id, seq.request_id))

    def _detach(self, work: Coroutine[Any, Any, None], name: str | None = None) -> None:
        """Run `work` owned by the frontend, not this generation: closing the generation does not cancel it."""
        task = asyncio.create_task(work, name=name)
        self.svc.detached.add(task)
        task.add_done_callback(self.svc.detached.discard)

    def end(self, seq: Sequence, chunk: Chunk | None) -> None:
        """End a sequence with a chunk of the frontend's own; a resumable stream records it in Kafka."""
        if chunk is None:
            return
        self.stream.put(chunk)
        if self.resumable:
            self.own(self._note(chunk), f"note-{seq.request_id}")

    async def _note(self, chunk: Chunk) -> None:
        try:
            await self.svc.dispatcher.note(self.reply_topic, chunk)
        except APIError:
            log.warning("could not record the end of %s for resumed readers", chunk.request_id)

    # ---- the end -----------------------------------------------------------------------------------

    async def close(self) -> None:
        """The reader is done: cancel whatever still runs, unless a resumable stream should go on.

        A resumable stream whose client left while it was running keeps going unattended (its chunks
        are kept in Kafka for a resumed reader) for `resume_grace_s`, and as long after as a resumed
        reader is attached anywhere; then it is cancelled like any other.
        """
        if self._closed:
            return
        if self.resumable and not self._detached and not self._failed and not self.stream.finished:
            self._detached = True
            self._detach(self._unattended(), f"unattended-{self.id}")
            return
        self._closed = True
        if self.stream.finished and not self._failed:
            # At the end of the response: a stream's last event has been sent by now.
            self._m.e2e.observe(time.perf_counter() - self.started_at)
        for t in list(self._tasks):
            t.cancel()
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

    async def _unattended(self) -> None:
        """Run on without a client until done or nobody resumed it within the grace period."""
        grace = self.svc.resume_grace_s
        give_up = time.monotonic() + grace
        try:
            async with contextlib.aclosing(
                self.chunks(idle_s=min(grace, self.svc.keepalive_s) / 2)
            ) as batches:
                async for _ in batches:
                    if time.monotonic() < give_up:
                        continue
                    if await self.svc.resume.attached(self.id):
                        give_up = time.monotonic() + grace
                        continue
                    log.info("nobody resumed %s within %.0fs; cancelling it", self.id, grace)
                    break
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unattended stream %s failed", self.id)
        finally:
            self.resumable = False
            await self.close()


def _weakly(method: Callable[[Sequence, Chunk], None]) -> Callable[[Sequence, Chunk], None]:
    """`method`, without keeping its object alive."""
    ref = weakref.WeakMethod(method)

    def call(seq: Sequence, chunk: Chunk) -> None:
        bound = ref()
        if bound is not None:
            bound(seq, chunk)

    return call
