"""One client request in flight: its sequences on workers, their chunks, and their cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from kvstore.resume_store import ResumeStore
from schemas.kafka import Chunk, ChunkUsage, ErrorInfo, GenerateRequest
from server.delivery import RequestLog
from server.errors import APIError
from server.kafka_io import Dispatcher, ReplyDemux
from server.metrics import FrontendMetrics
from server.pool import WorkerPool
from server.preprocess import Prepared
from server.router import AllBusy, Decision, PromptMemo, Router
from server.streams import ClientStream, Sequence, StreamSpec, marker

log = logging.getLogger("ferry.frontend")

# A move whose marker, or first chunk, did not come back this long after it went out is made again, at most
# MOVE_STALLS times: a broker that restarted empty (Tansu) can lose what a move sends.
MOVE_STALL_S = 10.0
MOVE_STALLS = 3
# After the broker lost the replies log (Tansu restarted empty), how long a first attempt that stays silent
# past `--delivery-check-s` is sent again although its request is still in the worker's topic: Tansu can
# also lose replies a worker writes in the first seconds after its restart, and then nothing else would
# ever answer the request. A needless second attempt in that window costs one prefill.
REPLIES_IN_DOUBT_S = 60.0

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
    request_timeout_s: float
    keepalive_s: float
    busy_wait_s: float = 5.0
    migration_limit: int = 3
    # Where a request with no answer after `delivery_check_s` is looked up (server/delivery.py).
    requests: RequestLog | None = None
    delivery_check_s: float = 10.0
    # Resumable streams (server/resume.py): where their records live, and how long one runs unattended.
    resume: ResumeStore | None = None
    resume_grace_s: float = 30.0
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
        self, svc: Services, model: str, prepared: Prepared, request_id: str, resumable: bool = False
    ) -> None:
        self.svc = svc
        self.model = model
        self.prepared = prepared
        self.id = request_id
        self.resumable = resumable
        self.stream = ClientStream(request_id, on_lost=self._worker_lost, on_gap=self._chunk_lost)
        self.created = int(time.time())
        self.started_at = time.perf_counter()
        self.first_token_at: float | None = None
        self._last_token_at = 0.0
        self.predicted_cached_blocks = 0
        # Where this request's chunks arrive (set by start): its replies topic, and an offset at or before
        # the first of them (for a resume record).
        self.reply_topic = ""
        self.first_offset = 0
        self.deadline = 0.0
        self._submitted: list[Sequence] = []
        # Sequences being moved, by request id: True if lost again meanwhile (move once more).
        self._moving: dict[str, bool] = {}
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
        self.reply_topic, self.first_offset = self.svc.demux.register(self.stream)
        self.deadline = time.time() + self.svc.request_timeout_s
        try:
            for seq in self.stream.sequences.values():
                request = self._request(seq)
                offset = await self.svc.dispatcher.submit(seq.worker_id, request)
                self._watch(seq, request, offset)
        except BaseException:
            self.resumable = False
            await self.close()
            raise

    def _request(self, seq: Sequence, generated: list[int] | None = None) -> GenerateRequest:
        """The GenerateRequest of one sequence; with `generated`, of its next attempt."""
        p = self.prepared
        prior = generated or []
        return GenerateRequest(
            request_id=seq.request_id,
            model=self.model,
            prompt_token_ids=p.prompts[seq.prompt_index],
            max_tokens=p.max_tokens - len(prior),
            reply_topic=self.reply_topic,
            sampling=p.sampling,
            index=seq.choice,
            priority=p.priority,
            deadline=self.deadline,
            generated_token_ids=prior,
            attempt=seq.attempt,
            frontend_id=self.svc.frontend_id,
            seq_base=seq.next_seq,
        )

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

    async def chunks(self, idle_s: float | None = None) -> AsyncGenerator[list[tuple[Sequence, Chunk]], None]:
        """Batches of chunks as they arrive; an empty batch means `idle_s` (the keep-alive) passed."""
        wait_s = self.svc.keepalive_s if idle_s is None else idle_s
        idle_since = time.monotonic()
        while not self.stream.drained:
            batch = await self.stream.get(wait_s)
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
                    if chunk.error is not None:
                        self._failed = True
                    if chunk.finish_reason is not None:
                        self._release(seq)
            elif now - idle_since > self.svc.request_timeout_s:
                for seq in self.stream.unfinished():
                    wait = self.svc.request_timeout_s
                    self._fail(seq, f"no progress from worker {seq.worker_id} for {wait:.0f}s", "timeout")
                continue
            yield batch

    def _release(self, seq: Sequence) -> None:
        if seq in self._submitted:
            self._submitted.remove(seq)
            self.svc.router.finished(seq.decision)

    # ---- migration -------------------------------------------------------------------------------

    def _worker_lost(self, seq: Sequence, worker_died: bool = True) -> None:
        """The sequence's worker left the registry (or its chunks were lost): move it (in the background)."""
        if self._closed or seq.finished:
            return
        if worker_died:
            seq.moves += 1
        rid = seq.request_id
        if rid in self._moving:
            # Lost again while moving: two moves at once would both claim the next attempt with different
            # tokens so far. (A broker that loses its log twice, as Tansu does after an empty restart,
            # takes the move's own marker or request with it.) Move once more when this move is done, or
            # at once if it still waits for its marker, which may have gone with the log.
            self._moving[rid] = True
            seq.switched.set()
            seq.progressed.set()
            return
        self._moving[rid] = False
        task = asyncio.create_task(self._migrate(seq), name=f"migrate-{rid}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _chunk_lost(self, seq: Sequence) -> None:
        """A reply chunk of the sequence never reached the topic: its attempt cannot go on, so move it."""
        self.svc.metrics.reply_gaps.inc()
        self._worker_lost(seq, worker_died=False)

    async def _migrate(self, seq: Sequence) -> None:
        rid = seq.request_id
        try:
            while True:
                sent = await self._move(seq)
                if not self._moving.get(rid) and sent is not None and not await self._started(seq, sent[0]):
                    self._stalled(seq, f"nothing came from worker {seq.worker_id} within {MOVE_STALL_S:.0f}s")
                if not self._moving.get(rid) or seq.finished or self._closed:
                    return
                self._moving[rid] = False
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("migrating %s failed", rid)
            self._fail(seq, f"could not move the sequence: {exc!r}")
        finally:
            self._moving.pop(rid, None)

    def _stalled(self, seq: Sequence, what: str) -> None:
        """A move went wrong: a broker that lost its log (Tansu restarted empty) can lose what a move sends
        too (its marker, its request). Move again, a few times; then give up."""
        if seq.stalls == MOVE_STALLS:
            self._fail(seq, f"moving the sequence failed: {what}, {MOVE_STALLS + 1} times")
            return
        seq.stalls += 1
        log.warning("%s: %s; moving it again", seq.request_id, what)
        self._moving[seq.request_id] = True

    async def _started(self, seq: Sequence, request: GenerateRequest) -> bool:
        """True once the moved sequence produced a chunk (or ended, or was lost again); False after
        MOVE_STALL_S without any.

        A timer, not the delivery check: after an empty restart Tansu can also refuse a worker's replies
        for good (a replies topic it re-created from a produce), and a move made again is what gets the
        stream going then (tests/integration/test_outage.py). A move is rare enough that one made again
        under a prefill longer than MOVE_STALL_S costs little.
        """
        rid = seq.request_id
        try:
            async with asyncio.timeout(MOVE_STALL_S):
                while seq.next_seq <= request.seq_base and not seq.finished and not self._moving.get(rid):
                    seq.progressed.clear()
                    await seq.progressed.wait()
        except TimeoutError:
            return seq.finished or self._closed
        return True

    def _watch(self, seq: Sequence, request: GenerateRequest, offset: int) -> None:
        """Send a first attempt again if it gets no answer and the broker no longer holds its request."""
        if self.svc.requests is None:
            return

        async def watch() -> None:
            lost = await self._unanswered(seq, request, offset)
            if lost is None or seq.request_id in self._moving:
                return
            self.svc.metrics.requests_lost.inc()
            log.warning(
                "%s: no answer from worker %s after %.0fs and %s; sending it again",
                seq.request_id, seq.worker_id, self.svc.delivery_check_s, lost,
            )
            self._worker_lost(seq, worker_died=False)

        task = asyncio.create_task(watch(), name=f"watch-{seq.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _unanswered(self, seq: Sequence, request: GenerateRequest, offset: int) -> str | None:
        """Wait for the attempt sent at `offset` to produce a chunk (or to be ended or lost otherwise):
        None. After `delivery_check_s` without one, why it must be sent again: the broker no longer holds
        its request, or it lost its log lately, so the worker's replies may be gone too.

        Otherwise a request still in the log is waiting for its worker (a long prefill, a queue): wait on.
        """
        requests = self.svc.requests
        rid = request.request_id

        def waiting() -> bool:
            return (
                seq.next_seq <= request.seq_base
                and seq.attempt == request.attempt
                and not seq.finished
                and not self._closed
                and not self._moving.get(rid)
            )

        while waiting():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.svc.delivery_check_s):
                    while waiting():
                        seq.progressed.clear()
                        await seq.progressed.wait()
            if waiting() and requests is not None:
                held = await requests.holds(seq.worker_id, offset, request)
                if held is False and waiting():
                    return "the broker no longer holds its request (restarted empty?)"
                if held and waiting() and time.monotonic() - self.svc.demux.reset_at < REPLIES_IN_DOUBT_S:
                    return "the broker lost its log lately (its replies may be gone with it)"
        return None

    async def _move(self, seq: Sequence) -> tuple[GenerateRequest, int] | None:
        """Send the prompt and the tokens so far to another worker; its chunks continue the stream.

        Returns the request and its offset in the worker's topic, if it sent one.
        """
        # A move abandoned before its request went out leaves the worker that really runs the sequence here.
        old = seq.moved_from or seq.decision.worker_id
        limit = self.svc.migration_limit
        if seq.moves > limit:
            self._fail(
                seq,
                f"worker {old} stopped responding; the sequence already moved {seq.moves - 1} time(s) "
                f"(migration limit {limit})",
            )
            return None
        memo = PromptMemo(self.prepared.prompts[seq.prompt_index] + seq.token_ids)
        # A worker may be on its way (a restart, or this one back after a late heartbeat): wait for
        # one as long as for a busy one, then give up with a clear error.
        give_up = time.monotonic() + self.svc.busy_wait_s
        while True:
            try:
                decision = await self._choose(memo)
                break
            except APIError as exc:
                remaining = give_up - time.monotonic()
                if exc.code != "no_workers" or remaining <= 0:
                    self._fail(
                        seq,
                        f"worker {old} stopped responding and no other worker can take over: {exc.message}",
                    )
                    return None
                await self.svc.pool.wait_refreshed(remaining)
        if seq.finished or self._closed or seq not in self._submitted:
            return None
        # Load moves with the sequence (no await between the check above and these lines).
        self.svc.router.finished(seq.decision)
        self.svc.router.started(decision)
        seq.decision = decision
        seq.moved_from = old
        target = seq.attempt + 1
        # The marker goes into the replies topic first: from where it lands, only chunks of the new
        # attempt count, for this stream and for any replay of it. Wait until it came back.
        seq.switched.clear()
        try:
            await self._while_broker_away(
                lambda: self.svc.dispatcher.note(
                    self.reply_topic, marker(seq.request_id, target, decision.worker_id)
                )
            )
        except APIError as exc:
            self._fail(seq, f"worker {old} stopped responding; moving the sequence failed: {exc!r}")
            return None
        try:
            async with asyncio.timeout(MOVE_STALL_S):
                while seq.attempt < target and not seq.finished:
                    await seq.switched.wait()
                    seq.switched.clear()
                    if self._moving.get(seq.request_id) and seq.attempt < target:
                        # Lost again before the marker came back: the broker may have lost it too. Start
                        # over; no request went out, so the next move may claim the same attempt.
                        return None
        except TimeoutError:
            self._stalled(seq, f"its marker did not come back within {MOVE_STALL_S:.0f}s")
            return None
        # Only now may the old worker be stopped: its abort would otherwise have ended the sequence. (It
        # may be alive after all, e.g. its heartbeats were late; it may even be the worker chosen now.)
        await self.svc.dispatcher.cancel(old, seq.request_id)
        seq.moved_from = ""
        if seq.finished:
            return None  # the old worker's last chunk landed before the marker
        generated = list(seq.token_ids)
        if len(generated) >= self.prepared.max_tokens:
            # Every token arrived but not the final chunk: end it here, as the worker would have.
            usage = ChunkUsage(seq.prompt_len, len(generated))
            self._end(
                seq,
                Chunk(
                    seq.request_id,
                    seq.next_seq,
                    finish_reason="length",
                    usage=usage,
                    worker_id=old,
                    attempt=seq.attempt,
                ),
            )
            return None
        log.warning(
            "moving %s from worker %s to %s (attempt %d, %d token(s) so far)",
            seq.request_id,
            old,
            decision.worker_id,
            target,
            len(generated),
        )
        try:
            request = self._request(seq, generated)
            # No cancel behind a timed-out copy: the next copy is the same attempt and must run (the worker
            # runs whichever arrives first and drops the other as a duplicate).
            offset = await self._while_broker_away(
                lambda: self.svc.dispatcher.submit(decision.worker_id, request, cancel_on_timeout=False)
            )
        except APIError as exc:
            self._fail(seq, f"worker {old} stopped responding; moving the sequence failed: {exc.message}")
            return None
        return request, offset

    async def _while_broker_away(self, send: Callable[[], Awaitable[T]]) -> T:
        """Send, and send again while the broker is unavailable, up to --request-timeout-s.

        A worker often dies together with the broker's outage (or the broker's restart is what lost the
        sequence): the move must outlast it, not fail on it. Each attempt waits up to --kafka-timeout-s
        for the broker, which paces the retries.
        """
        give_up = time.monotonic() + self.svc.request_timeout_s
        while True:
            try:
                return await send()
            except APIError as exc:
                if exc.code != "broker_unavailable" or time.monotonic() > give_up or self._closed:
                    raise

    def _fail(self, seq: Sequence, message: str, code: str = "worker_died") -> None:
        """End a sequence with a (retriable) error of the frontend's own, and stop its worker on it."""
        worker_id = seq.worker_id
        self._end(seq, self.stream.ending(seq.request_id, ErrorInfo(code, message, retriable=True)))
        # Owned by the frontend, not this generation: closing it must not drop the Cancel.
        task = asyncio.create_task(self.svc.dispatcher.cancel(worker_id, seq.request_id))
        self.svc.detached.add(task)
        task.add_done_callback(self.svc.detached.discard)

    def _end(self, seq: Sequence, chunk: Chunk | None) -> None:
        """End a sequence with a chunk of the frontend's own; a resumable stream records it in Kafka."""
        if chunk is None:
            return
        self.stream.put(chunk)
        if self.resumable:
            task = asyncio.create_task(self._note(chunk), name=f"note-{seq.request_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
            task = asyncio.create_task(self._unattended(), name=f"unattended-{self.id}")
            self.svc.detached.add(task)
            task.add_done_callback(self.svc.detached.discard)
            return
        self._closed = True
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
                    resume = self.svc.resume
                    if resume is not None and await resume.attached(self.id):
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


def error_status(error: ErrorInfo) -> APIError:
    """The HTTP error for a sequence that failed before anything was streamed."""
    if error.code == "context_length_exceeded":
        return APIError(400, error.message, code=error.code)
    if error.retriable:
        return APIError(503, error.message, code=error.code, retry_after=1)
    return APIError(500, error.message, code=error.code)
