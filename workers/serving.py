"""Sequences on the engine: each engine delta becomes one Chunk on the outbox; cancels and what is in flight."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bus.topics import RequestTopics
from kvstore.bells import Bells
from schemas.kafka import Chunk, ChunkUsage, ErrorInfo, FinishReason, GenerateRequest, KVFrom, Release
from workers.engine import Engine, EngineDead, EngineError, EngineOutput
from workers.engine_base import OutputStream
from workers.metrics import WorkerMetrics
from workers.outbox import Outbox
from workers.parking import Parking

log = logging.getLogger("ferry.worker")


def chunk_of(req: GenerateRequest, seq: int, out: EngineOutput, worker_id: str, usage: ChunkUsage | None) -> Chunk:
    """The Chunk carrying one engine delta of `req` as its `seq`-th chunk.

    A prefill-only attempt's token that ends it by length has no finish reason and no usage: the sequence
    goes on on a decode worker, whose last chunk carries them (a natural stop still ends it here).
    """
    if req.prefill_only and out.finish_reason == "length":
        out, usage = msgspec.structs.replace(out, finish_reason=None), None
    return Chunk(
        request_id=req.request_id,
        seq=seq,
        token_ids=out.token_ids,
        text=out.text,
        finish_reason=out.finish_reason,
        stop_reason=out.stop_reason,
        usage=usage,
        worker_id=worker_id,
        logprobs=out.logprobs,
        prompt_logprobs=out.prompt_logprobs,
        attempt=req.attempt,
    )


def ending(req: GenerateRequest, seq: int, worker_id: str, error: ErrorInfo | None = None) -> Chunk:
    """The chunk that ends `req` without output: aborted, or failed with `error`."""
    reason: FinishReason = "abort" if error is None else "error"
    return Chunk(req.request_id, seq, finish_reason=reason, worker_id=worker_id, error=error, attempt=req.attempt)


class _Attempt:
    """One attempt's progress on the engine: where its chunk numbers are, and its timing so far."""

    __slots__ = (
        "aborted", "finished", "first", "first_chunk", "generated", "last_at", "queued", "req", "seq", "started",
        "task",
    )  # fmt: skip

    def __init__(self, req: GenerateRequest, task: asyncio.Task[None], first_chunk: Chunk | None) -> None:
        self.req = req
        self.task = task
        # A released hand-off's token, sent as this attempt's first chunk when the engine first schedules it.
        self.first_chunk = first_chunk
        self.seq = req.seq_base  # a migrated request continues the sequence numbers its stream already used
        self.generated = len(req.generated_token_ids)
        # From this many generated tokens on, the next output is the last.
        self.last_at = self.generated + req.max_tokens - 1
        self.started, self.first, self.queued = time.monotonic(), 0.0, 0.0
        self.finished = self.aborted = False


class Serving:
    """Runs each accepted request as a task that streams its chunks, and tracks what is in flight."""

    def __init__(
        self,
        engine: Engine,
        outbox: Outbox,
        metrics: WorkerMetrics,
        worker_id: str,
        on_fatal: Callable[[BaseException], None],
        request_topics: RequestTopics | None = None,
        bells: Bells | None = None,
    ) -> None:
        self._engine = engine
        self._bells = bells  # rings a decode worker once its release is in its topic
        # Which request topic of a worker is current: where a decode-first release goes.
        self._request_topics = request_topics or RequestTopics(0)
        self._outbox = outbox
        self._metrics = metrics
        self._worker_id = worker_id
        self._on_fatal = on_fatal
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._attempts: dict[asyncio.Task[None], int] = {}  # the attempt each task serves
        # Decode-first hand-offs parked here until their prefill worker releases them (workers/parking.py).
        self.parking = Parking(worker_id, self.start)
        # In-flight attempts a Cancel named (dropped when they end). The task, not the request id: a
        # newer attempt of the same request (a migration back to this worker) must not inherit the cancel.
        self._cancelled: set[asyncio.Task[None]] = set()
        # In-flight attempts whose next output is their last (one token to go, or prefill-only). When they are
        # all there is, the engine's work ends with their outputs, and a request read late then waits for
        # nothing: the inbox does not pace its fetches (`busy_after_step`).
        self._last_step: set[asyncio.Task[None]] = set()
        # The engine's recent time per decode step (an average over sequences' inter-token times).
        self.step_s = 0.0
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        # What requests cut short tell their frontends: set by fail_all. None (abandon) sends no last word, so
        # frontends count them lost once this worker leaves the registry and move them to another worker.
        self._stop_error: ErrorInfo | None = None

    def __len__(self) -> int:
        return len(self._inflight)

    @property
    def busy_after_step(self) -> bool:
        """Whether some attempt in flight has more than one output to go (the engine has work beyond them)."""
        return len(self._last_step) < len(self._inflight)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._inflight

    def running(self, request_id: str) -> asyncio.Task[None] | None:
        """The task serving `request_id`, if it is running."""
        return self._inflight.get(request_id)

    def start(self, req: GenerateRequest, first: Chunk | None = None) -> asyncio.Task[None]:
        """Serve `req` in a task of its own (sending `first`, a released hand-off's token, before its output)."""
        task = asyncio.create_task(self._serve(req, first), name=f"serve-{req.request_id}")
        self._inflight[req.request_id] = task
        self._attempts[task] = req.attempt
        self.idle.clear()
        task.add_done_callback(functools.partial(self._done, req.request_id))
        return task

    async def cancel(self, request_id: str, attempt: int = -1) -> None:
        """A frontend's Cancel (of `attempt` only, unless -1): abort the request in the engine, even if it has not
        reached it yet; a parked attempt is dropped."""
        self.parking.discard(request_id, attempt)
        task = self._inflight.get(request_id)
        if task is None or attempt not in (-1, self._attempts.get(task)):
            return
        log.debug("cancel %s", request_id)
        # The request may have arrived in the same batch and not reached the engine yet, where an abort
        # finds nothing to stop: `_serve` checks this set before and after it starts.
        self._cancelled.add(task)
        await self._engine.abort(request_id)

    async def supersede(self, req: GenerateRequest) -> None:
        """A newer attempt of a request that still runs here: a frontend thought this worker dead (a late
        heartbeat) and moved the request, back to us. Stop the old attempt before the new one starts."""
        old = self._inflight[req.request_id]
        log.info("request %s: attempt %d replaces the one running here", req.request_id, req.attempt)
        await self._engine.abort(req.request_id)
        _, pending = await asyncio.wait([old], timeout=5.0)
        if pending:
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)

    async def fail_all(self, error: ErrorInfo) -> None:
        """End every request in flight with `error`."""
        self._stop_error = error
        for rid, task in list(self._inflight.items()):
            task.cancel()
            with contextlib.suppress(Exception):  # a dead engine may refuse it; the task's last word goes anyway
                await self._engine.abort(rid)
        await self._cancel_all()

    async def abandon(self) -> None:
        """End every request in flight without a last chunk: frontends count them lost and move them."""
        self._stop_error = None
        await self._cancel_all()

    async def _cancel_all(self) -> None:
        """Cancel every request still in flight and wait for their tasks."""
        tasks = list(self._inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _done(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._inflight.get(request_id) is task:
            del self._inflight[request_id]
        self._cancelled.discard(task)
        self._last_step.discard(task)
        self._attempts.pop(task, None)
        if not self._inflight:
            self.idle.set()

    def _timing(self, started: float, first: float, queued: float) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds of a sequence that ends now; observed unless it never produced."""
        if not first:
            return 0.0, 0.0, 0.0
        now = time.monotonic()
        prefill = max(first - started - queued, 0.0)
        m = self._metrics
        m.queue_seconds.observe(queued)
        m.prefill_seconds.observe(prefill)
        m.decode_seconds.observe(now - first)
        return queued, prefill, now - first

    def _note_steps(self, decode_s: float, tokens: int) -> None:
        if tokens > 1 and decode_s > 0:
            step = decode_s / (tokens - 1)
            self.step_s = step if not self.step_s else 0.8 * self.step_s + 0.2 * step

    def _release(self, req: GenerateRequest, chunk: Chunk, connector: dict[str, Any] | None) -> None:
        """A prefill-only attempt's token: the decode worker's parked next attempt starts with it (decode-first
        hand-off), with what its engine's KV connector needs (`connector`); sent ahead of the chunk to the
        frontend, which gets the token from either."""
        if not (req.release_to and req.prefill_only and chunk.token_ids and chunk.finish_reason is None):
            return
        kv_from = KVFrom(self._worker_id, len(req.prompt_token_ids), connector)
        release = Release(req.request_id, req.attempt + 1, chunk, kv_from)
        # Into the decode worker's current epoch (it created that topic ahead): its unrolled topic is never
        # trimmed on the embedded broker, and a record per disaggregated request would grow it for good.
        bells, to = self._bells, req.release_to
        delivered = None if bells is None else lambda: bells.ring_soon(to)
        self._outbox.put_request(self._request_topics.current(to), release, delivered)

    def _send_first(self, att: _Attempt) -> None:
        """A released hand-off's token, once, as the attempt's first chunk (workers/parking.py)."""
        if att.first_chunk is not None:
            chunk, att.first_chunk = att.first_chunk, None
            self._outbox.put(att.req, chunk, urgent=True)

    def _ending(self, att: _Attempt, error: ErrorInfo | None = None) -> Chunk:
        """The attempt's last chunk without output (aborted, or failed with `error`), after its hand-off's token."""
        self._send_first(att)
        return ending(att.req, att.seq, self._worker_id, error)

    def _on_output(self, att: _Attempt, out: EngineOutput) -> None:
        """One engine delta of an attempt: its chunk on the outbox, its figures in the metrics."""
        req, metrics = att.req, self._metrics
        if att.first_chunk is not None:
            self._send_first(att)
        att.generated += len(out.token_ids)
        if att.generated >= att.last_at:
            self._last_step.add(att.task)
        first = bool(out.token_ids) and not att.first
        if first:
            att.first, att.queued = time.monotonic(), out.queued_s
        usage = None
        if out.finish_reason is not None:
            att.finished = True
            att.aborted = out.finish_reason == "abort"
            prompt = out.prompt_tokens or len(req.prompt_token_ids)
            timing = self._timing(att.started, att.first, att.queued)
            usage = ChunkUsage(prompt, att.generated, out.cached_tokens, *timing)
            self._note_steps(timing[2], att.generated - len(req.generated_token_ids))
            if att.first:  # scheduled: its prompt was looked up in the prefix cache
                metrics.prefix_queries.inc(prompt)
                metrics.prefix_hits.inc(out.cached_tokens)
            metrics.cached_tokens.inc(out.cached_tokens)
        metrics.generated_tokens.inc(len(out.token_ids))
        chunk = chunk_of(req, att.seq, out, self._worker_id, usage)
        self._release(req, chunk, out.kv_transfer)
        # A first token never lingers (its client's TTFT), nor a lone sequence's tokens: there is no other
        # sequence's to share a record with, and a frontend reading one stream is the most sensitive to when its
        # records come (its replies reader's brief polls meet a first token later, bench.overhead at 1 stream).
        # Nor anything of an engine whose steps take longer than the linger: it has nothing to gather (vLLM on
        # a CPU, 50 ms a step), and a step's outputs read by one task per sequence would wait for nothing.
        urgent = first or len(self._inflight) == 1 or self.step_s >= self._outbox.linger_s
        self._outbox.put(req, chunk, urgent=urgent)
        att.seq += 1

    async def _generate(self, att: _Attempt) -> None:
        """Run the attempt's sequence on the engine, each delta through `_on_output`."""
        outputs = self._engine.generate(att.req)
        if att.first_chunk is not None:
            # A hand-off's token goes out when the sequence joins the engine's batch, one step before the next
            # token, so the frontend can give the client both at the decode worker's pace (server/streams.py).
            send = functools.partial(self._send_first, att)
            if not (isinstance(outputs, OutputStream) and outputs.when_scheduled(send)):
                send()
        if isinstance(outputs, OutputStream):
            done = outputs.push_to(functools.partial(self._on_output, att))
            if done is not None:
                # The engine calls _on_output inside its step; a cancel here cancels `done` first, so the
                # abort below sends nothing (an abandoned stream gets no last word).
                try:
                    await done
                finally:
                    await outputs.aclose()
                return
        reaborted = False
        async for out in outputs:
            if not reaborted and att.task in self._cancelled:
                # Cancelled while the engine was still taking it in, where its abort found nothing.
                reaborted = True
                await self._engine.abort(att.req.request_id)
            self._on_output(att, out)
            await self._outbox.room()

    async def _serve(self, req: GenerateRequest, first_chunk: Chunk | None = None) -> None:
        """Run one sequence and send every delta back as a Chunk."""
        me = asyncio.current_task()
        assert me is not None
        att = _Attempt(req, me, first_chunk)
        metrics = self._metrics
        metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        try:
            if req.prefill_only or att.generated >= att.last_at:
                self._last_step.add(me)
            # Cancelled before it started: nothing to generate, the abort chunk below ends it.
            if me not in self._cancelled:
                await self._generate(att)
            if not att.finished:
                # The engine ended the sequence without a reason: it was aborted (client cancel).
                self._outbox.put(req, self._ending(att))
                metrics.requests.labels("aborted").inc()
            else:
                # An engine that reports the abort itself (the sim engine does) ended it on a Cancel too.
                metrics.requests.labels("aborted" if att.aborted else "finished").inc()
        except asyncio.CancelledError:
            if self._stop_error is not None:
                self._outbox.send_final_nowait(req, self._ending(att, self._stop_error))
            metrics.requests.labels("cancelled").inc()
            raise
        except EngineError as exc:
            # An EngineDead's is the attempt's last word that the engine died under it (code ENGINE_DEAD): its
            # frontend moves the sequence at once and counts the death against it; the client sees no error.
            self._outbox.put(req, self._ending(att, ErrorInfo(exc.code, str(exc), exc.retriable)))
            if isinstance(exc, EngineDead):
                self._on_fatal(exc)
            metrics.requests.labels("error").inc()
        except Exception as exc:
            log.exception("request %s failed in the engine", req.request_id)
            error = ErrorInfo("internal_error", f"{type(exc).__name__}: {exc}", retriable=True)
            self._outbox.put(req, self._ending(att, error))
            metrics.requests.labels("error").inc()
