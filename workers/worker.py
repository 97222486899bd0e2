"""One worker: reads its requests topic, runs them on an engine, streams chunks back, heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from bus.produce import refresh_metadata
from bus.reader import Batch, Hooks, Options, Own, Poll, Reader
from bus.topics import ensure_topics
from kvstore.batch_store import BatchStore
from kvstore.kv_index import KVIndex
from kvstore.registry import Registry
from schemas.kafka import (
    Cancel,
    Chunk,
    ChunkUsage,
    ErrorInfo,
    GenerateRequest,
    LoadLora,
    LoraAck,
    RequestMessage,
    UnloadLora,
    request_decoder,
    request_encoder,
)
from schemas.names import RedisKeys, pool_topic, request_topic
from schemas.settings import WorkerSettings
from schemas.status import HEARTBEAT_MISSES, WorkerStatus
from workers.engine import Engine, EngineDead, EngineError, EngineOutput
from workers.kv_publisher import KVPublisher
from workers.lora import LoraControl, adapters_of
from workers.metrics import WorkerMetrics
from workers.pool_consumer import PoolConsumer

log = logging.getLogger("ferry.worker")

# Produces of one reply record before it counts as lost (Tansu fails a produce once with UnknownError for
# a topic that changed under the producer's metadata, e.g. after an empty restart).
SEND_TRIES = 3
# Routed requests remembered for deduplication: a redelivered one is not run (and answered) twice.
SEEN_REQUESTS = 65536
READY_MARK = "ferry-worker-ready"


async def ensure_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    """Create `topic` if it does not exist yet."""
    await ensure_topics(bootstrap, {topic: partitions})


async def _no_outputs() -> AsyncIterator[EngineOutput]:
    """The outputs of a sequence that never reaches the engine."""
    return
    yield


class Outgoing(NamedTuple):
    """One record on its way to a frontend's topic, and how often producing it failed so far."""

    topic: str
    key: bytes
    value: bytes
    tries: int = 0


class Worker:
    """Owns the engine, the Kafka inbox and producer, the heartbeat, and every in-flight request."""

    def __init__(self, settings: WorkerSettings, engine: Engine, engine_name: str) -> None:
        self.settings = settings
        self.engine = engine
        self.engine_name = engine_name
        self.metrics = WorkerMetrics()
        self.topic = request_topic(settings.worker_id)
        self._inflight: dict[str, asyncio.Task[None]] = {}
        # (request id, attempt) of routed requests started lately, oldest first (bounded).
        self._seen: OrderedDict[tuple[str, int], None] = OrderedDict()
        # In-flight attempts a Cancel named (dropped when they end). The task, not the request id: a
        # newer attempt of the same request (a migration back to this worker) must not inherit the cancel.
        self._cancelled: set[asyncio.Task[None]] = set()
        self.idle = asyncio.Event()  # set while no request is in flight
        self.idle.set()
        self._draining = False
        self._left = False  # set by _leave: no heartbeat may register us again
        self._publishing: asyncio.Future[None] | None = None
        self._started_at = time.time()
        self._metrics_url = ""
        self._producer: AIOKafkaProducer | None = None
        self._registry: Registry | None = None
        self._redis_ok = True
        self._fatal: BaseException | None = None
        self._fatal_event = asyncio.Event()
        self.ready = asyncio.Event()  # set once registered and consuming
        # LoRA load/unload from frontends (workers/lora.py); answers go to the asking frontend's topic.
        self.lora = LoraControl(engine, settings.worker_id, self._heartbeat_once, self._send_ack)
        # What requests cut short by _fail_all tell their clients.
        self._stop_error = ErrorInfo("worker_stopped", "worker stopped before finishing", retriable=True)
        self.pool: PoolConsumer | None = None  # batch work (workers/pool_consumer.py), unless --no-pool
        # One sender keeps every request's chunks in order and pushes back on the engine when Kafka lags.
        self._outbox: asyncio.Queue[Outgoing] = asyncio.Queue(maxsize=4096)
        self._resends: set[asyncio.Task[None]] = set()
        self._closing: asyncio.Future[None] | None = None  # the clean-up, once run() ends

    # ---- lifecycle -----------------------------------------------------------------------------

    async def run(self, shutdown: asyncio.Event) -> int:
        """Serve until `shutdown` is set, then drain; the return value is the process exit code."""
        s = self.settings
        self._metrics_url = self.metrics.serve(s.metrics_host, s.metrics_port)
        redis = aioredis.from_url(s.redis, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._registry = Registry(redis, RedisKeys(s.redis_prefix))
        self._kv_index = KVIndex(redis, RedisKeys(s.redis_prefix))
        self._kv = KVPublisher(self._kv_index, s.worker_id, s.served_model_name, self.metrics)
        self._producer = AIOKafkaProducer(bootstrap_servers=s.kafka, linger_ms=0, request_timeout_ms=10_000)
        inbox = self._inbox = Reader(
            "requests",
            s.kafka,
            request_decoder,
            Options(
                fetch_wait_ms=s.kafka_fetch_wait_ms,
                poll=Poll(1000, 256),
                # An idle worker sees nothing fail while the broker is away (no commit, no reply), so the
                # check cannot wait for an error: a position past the fetch's high watermark is the only sign
                # that the broker came back without this log, and on a healthy log it never holds.
                watch_reset=True,
                # Commit once the engine holds the requests: a restart under the same id resumes after them.
                commit_after_poll=True,
                group_id=f"ferry-worker-{s.worker_id}",
                offset_reset="earliest",
            ),
            Hooks(self._dispatch_all, failed=self._set_fatal, reset=self._log_lost),
        )
        tasks: list[asyncio.Task[None]] = []
        try:
            # Inside the try: a start that fails (broker down) must still stop the engine and the clients.
            await self.engine.start()
            await ensure_topic(s.kafka, self.topic)
            await self._producer.start()
            await inbox.open(Own(self.topic))
            if s.pool:
                await ensure_topic(s.kafka, pool_topic(s.served_model_name), s.pool_partitions)
                self.pool = PoolConsumer(s, self, BatchStore(redis, RedisKeys(s.redis_prefix)), self.metrics.registry)
                await self.pool.start()
            # A previous process under this id may have left index entries its cache no longer backs.
            await self._kv_index.clear_worker(s.worker_id)
            # Register only once the inbox is positioned, so nothing routed to us can be missed.
            await self._heartbeat_once()
            self.ready.set()
            # A line for launchers to wait on, printed whatever the log level.
            print(f"{READY_MARK} {s.worker_id}", file=sys.stderr, flush=True)
            log.info(
                "worker %s ready: engine=%s model=%s topic=%s metrics=%s",
                s.worker_id, self.engine_name, s.served_model_name, self.topic, self._metrics_url,
            )
            inbox.run()
            tasks = [
                asyncio.create_task(self._guard("outbox", self._send_loop())),
                asyncio.create_task(self._guard("heartbeat", self._heartbeat_loop())),
                asyncio.create_task(self._guard("health", self._health_loop())),
                asyncio.create_task(self._guard("kv-events", self._drain_kv_events())),
            ]
            if self.pool is not None:
                self.pool.run()
            fatal = asyncio.create_task(self._fatal_event.wait())
            stop = asyncio.create_task(shutdown.wait())
            await asyncio.wait([stop, fatal], return_when=asyncio.FIRST_COMPLETED)
            fatal.cancel()
            stop.cancel()
            if self._fatal is not None:
                log.error("worker %s stopping after a fatal error: %r", s.worker_id, self._fatal)
                await self._leave()
                await self._fail_all(ErrorInfo("engine_dead", str(self._fatal), retriable=True))
                return 1
            await self._drain()
            return 0
        finally:
            # Shielded: a caller that gives up on the drain (a cancelled task) must not leave the Kafka
            # clients running; the clean-up then finishes in the background.
            self._closing = asyncio.ensure_future(self._close(tasks, inbox, redis))
            await asyncio.shield(self._closing)

    async def _close(
        self, tasks: list[asyncio.Task[None]], inbox: Reader[RequestMessage], redis: aioredis.Redis
    ) -> None:
        """Stop the loops and in-flight requests, hand queued chunks to the producer, close every client."""
        assert self._producer is not None
        sender = tasks[0] if tasks else None
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await inbox.stop()  # before anything else: read nothing more
        for t in tasks:
            if t is not sender:
                t.cancel()
        for t in list(self._inflight.values()):
            t.cancel()
        await asyncio.gather(*(t for t in tasks if t is not sender), return_exceptions=True)
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        if sender is not None:
            # Hand every queued chunk (final ones included) to the producer, whose stop() flushes them.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox.join(), timeout=5.0)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        for t in self._resends:
            t.cancel()  # nothing sends them any more
        await asyncio.gather(*self._resends, return_exceptions=True)
        # Nothing cancels this task (its caller holds it through a shield), so a CancelledError here comes from
        # inside a client whose own retries were cut short by the broker's absence: go on to the next one.
        closers: list[Callable[[], Awaitable[object]]] = [self._producer.stop, self.lora.close, self.engine.stop, redis.aclose]  # fmt: skip
        if self.pool is not None:
            pool = self.pool
            closers.insert(0, lambda: pool.close(commit=False))
        for close in closers:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await close()
        log.info("worker %s stopped", self.settings.worker_id)

    async def _guard(self, name: str, coro: Awaitable[None]) -> None:
        """Run a background loop; an unexpected exit is fatal for the worker, never silent."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("worker task %s failed", name)
            self._set_fatal(exc)

    def fail(self, exc: BaseException) -> None:
        """A background part of the worker died (the pool's reader): the worker stops."""
        self._set_fatal(exc)

    def _set_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self._fatal_event.set()

    async def _drain(self) -> None:
        """Leave routing at once, let in-flight requests finish within the grace period, commit."""
        s = self.settings
        self._draining = True
        if self.pool is not None:
            self.pool.stop_taking()
        # Heartbeats go on with draining=True: routers stop choosing us, while frontends still see us
        # alive and keep waiting for the requests we finish. We leave the registry only at the end.
        with contextlib.suppress(Exception):
            await self._heartbeat_once()
        n = len(self._inflight)
        log.info("worker %s draining: %d request(s) in flight, grace %.0fs", s.worker_id, n, s.drain_grace_s)
        if n:
            try:
                await asyncio.wait_for(self.idle.wait(), timeout=s.drain_grace_s)
            except TimeoutError:
                log.warning("worker %s: grace period over, aborting %d request(s)", s.worker_id, len(self._inflight))
                await self._fail_all(ErrorInfo("worker_stopped", "worker stopped before finishing", retriable=True))
        await self._flush()
        with contextlib.suppress(KafkaError, TimeoutError):
            await self._inbox.commit()
        if self.pool is not None:
            # Commit finished batch items and leave the group: the others take our partitions at once.
            await self.pool.close()
        await self._leave()

    async def _flush(self) -> None:
        """Wait until every queued chunk has been acknowledged by the broker (bounded)."""
        assert self._producer is not None
        try:
            await asyncio.wait_for(self._outbox.join(), timeout=5.0)
            await asyncio.wait_for(self._producer.flush(), timeout=5.0)
        except (TimeoutError, KafkaError) as exc:
            log.warning("could not flush every reply before leaving: %r", exc)

    async def _leave(self) -> None:
        assert self._registry is not None
        self._left = True
        if self._publishing is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._publishing)
        try:
            await asyncio.shield(self._registry.remove(self.settings.worker_id))
            await asyncio.shield(self._kv_index.clear_worker(self.settings.worker_id))
        except Exception as exc:  # the TTL removes us anyway
            log.warning("could not leave the registry (%r); it expires in %.1fs", exc, self._ttl_s())

    async def _fail_all(self, error: ErrorInfo) -> None:
        self._stop_error = error
        for rid, task in list(self._inflight.items()):
            task.cancel()
            await self.engine.abort(rid)
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)

    # ---- inbox ---------------------------------------------------------------------------------

    async def _dispatch_all(self, batch: Batch[RequestMessage]) -> None:
        for _record, msg in batch.messages:
            await self._dispatch(msg)

    async def _log_lost(self, rewound: list[TopicPartition]) -> None:
        if self._producer is not None:
            await refresh_metadata(self._producer)  # the replies it writes next must be seen

    async def _dispatch(self, msg: RequestMessage) -> None:
        match msg:
            case GenerateRequest():
                key = (msg.request_id, msg.attempt)
                if key in self._seen:
                    # Redelivered (a producer retry, a re-read after a restart): already running or done.
                    self.metrics.requests.labels("duplicate").inc()
                    return
                if msg.request_id in self._inflight:
                    await self._supersede(msg)
                if msg.deadline and msg.deadline < time.time():
                    log.info("request %s arrived after its deadline; skipped", msg.request_id)
                    self.metrics.requests.labels("expired").inc()
                    return
                self._seen[key] = None
                if len(self._seen) > SEEN_REQUESTS:
                    self._seen.popitem(last=False)
                self._start(msg)
            case Cancel():
                if msg.request_id in self._inflight:
                    log.debug("cancel %s", msg.request_id)
                    # The request may have arrived in the same batch and not reached the engine yet, where
                    # an abort finds nothing to stop: `_serve` checks this set before and after it starts.
                    self._cancelled.add(self._inflight[msg.request_id])
                    await self.engine.abort(msg.request_id)
            case LoadLora() | UnloadLora():
                self.lora.submit(msg)

    async def _supersede(self, req: GenerateRequest) -> None:
        """A newer attempt of a request that still runs here: a frontend thought this worker dead (a late
        heartbeat) and moved the request, back to us. Stop the old attempt before the new one starts."""
        old = self._inflight[req.request_id]
        log.info("request %s: attempt %d replaces the one running here", req.request_id, req.attempt)
        await self.engine.abort(req.request_id)
        _, pending = await asyncio.wait([old], timeout=5.0)
        if pending:
            old.cancel()
            await asyncio.gather(old, return_exceptions=True)

    def _start(self, req: GenerateRequest) -> asyncio.Task[None]:
        task = asyncio.create_task(self._serve(req), name=f"serve-{req.request_id}")
        self._inflight[req.request_id] = task
        self.idle.clear()
        task.add_done_callback(functools.partial(self._done, req.request_id))
        return task

    # ---- hooks for the pool consumer (workers/pool_consumer.py) --------------------------------

    def start_request(self, req: GenerateRequest) -> asyncio.Task[None] | None:
        """Serve a batch item's request like a routed one; None if it is already running here."""
        if req.request_id in self._inflight:
            return None
        return self._start(req)

    def running_task(self, request_id: str) -> asyncio.Task[None] | None:
        """The task serving `request_id`, if it is running."""
        return self._inflight.get(request_id)

    async def flush_replies(self, timeout_s: float) -> bool:
        """Wait until every reply chunk queued so far is acknowledged by the broker; False on timeout."""
        assert self._producer is not None
        try:
            async with asyncio.timeout(timeout_s):
                await self._outbox.join()
                await self._producer.flush()
        except (TimeoutError, KafkaError):
            return False
        return True

    @property
    def failed(self) -> bool:
        """True once a fatal error stopped this worker."""
        return self._fatal is not None

    def _done(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self._inflight.get(request_id) is task:
            del self._inflight[request_id]
        self._cancelled.discard(task)
        if not self._inflight:
            self.idle.set()

    # ---- serving -------------------------------------------------------------------------------

    async def _serve(self, req: GenerateRequest) -> None:
        """Run one sequence and send every delta back as a Chunk."""
        wid = self.settings.worker_id
        # A migrated request continues the sequence numbers its stream already used.
        seq = req.seq_base
        attempt = req.attempt
        generated = len(req.generated_token_ids)
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))
        try:
            finished = aborted = reaborted = False
            me = asyncio.current_task()
            # Cancelled before it started: nothing to generate, the abort chunk below ends it.
            outputs = _no_outputs() if me in self._cancelled else self.engine.generate(req)
            async for out in outputs:
                if not reaborted and me in self._cancelled:
                    # Cancelled while the engine was still taking it in, where its abort found nothing.
                    reaborted = True
                    await self.engine.abort(req.request_id)
                generated += len(out.token_ids)
                usage = None
                if out.finish_reason is not None:
                    finished = True
                    aborted = out.finish_reason == "abort"
                    prompt = out.prompt_tokens or len(req.prompt_token_ids)
                    usage = ChunkUsage(prompt, generated, out.cached_tokens)
                    self.metrics.cached_tokens.inc(out.cached_tokens)
                self.metrics.generated_tokens.inc(len(out.token_ids))
                await self._send(
                    req,
                    Chunk(
                        request_id=req.request_id,
                        seq=seq,
                        token_ids=out.token_ids,
                        text=out.text,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        usage=usage,
                        worker_id=wid,
                        logprobs=out.logprobs,
                        attempt=attempt,
                    ),
                )
                seq += 1
            if not finished:
                # The engine ended the sequence without a reason: it was aborted (client cancel).
                await self._send(
                    req, Chunk(req.request_id, seq, finish_reason="abort", worker_id=wid, attempt=attempt)
                )
                self.metrics.requests.labels("aborted").inc()
            else:
                # An engine that reports the abort itself (the sim engine does) ended it on a Cancel too.
                self.metrics.requests.labels("aborted" if aborted else "finished").inc()
        except asyncio.CancelledError:
            self._outbox.put_nowait(
                self._encode(
                    req,
                    Chunk(
                        req.request_id, seq, finish_reason="error", worker_id=wid,
                        error=self._stop_error, attempt=attempt,
                    ),
                )
            )
            self.metrics.requests.labels("cancelled").inc()
            raise
        except EngineError as exc:
            if isinstance(exc, EngineDead):
                self._set_fatal(exc)
            await self._send(
                req,
                Chunk(
                    req.request_id, seq, finish_reason="error", worker_id=wid,
                    error=ErrorInfo(exc.code, str(exc), exc.retriable), attempt=attempt,
                ),
            )
            self.metrics.requests.labels("error").inc()
        except Exception as exc:
            log.exception("request %s failed in the engine", req.request_id)
            await self._send(
                req,
                Chunk(
                    req.request_id, seq, finish_reason="error", worker_id=wid,
                    error=ErrorInfo("internal_error", f"{type(exc).__name__}: {exc}", retriable=True),
                    attempt=attempt,
                ),
            )
            self.metrics.requests.labels("error").inc()

    @staticmethod
    def _encode(req: GenerateRequest, chunk: Chunk) -> Outgoing:
        return Outgoing(req.reply_topic, req.request_id.encode(), request_encoder.encode(chunk))

    async def _send(self, req: GenerateRequest, chunk: Chunk) -> None:
        """Queue one chunk for the request's reply topic (waits while the outbox is full)."""
        if self.pool is not None:
            merged = self.pool.coalesce(req, chunk)  # batch sequences send their output once, whole
            if merged is None:
                return
            chunk = merged
        await self._outbox.put(self._encode(req, chunk))

    async def _send_ack(self, topic: str, ack: LoraAck) -> None:
        await self._outbox.put(Outgoing(topic, ack.op_id.encode(), request_encoder.encode(ack)))

    async def _send_loop(self) -> None:
        assert self._producer is not None
        while True:
            out = await self._outbox.get()
            try:
                # Returns once the record is in the producer's batch; delivery is reported later.
                # Partition 0 is the only one a frontend reads (and spares hashing the key per chunk).
                delivery = await self._producer.send(out.topic, out.value, key=out.key, partition=0)
                delivery.add_done_callback(functools.partial(self._on_delivery, out))
            except KafkaError as exc:
                self._on_send_error(out, exc)
            finally:
                self._outbox.task_done()

    def _on_delivery(self, out: Outgoing, fut: asyncio.Future[object]) -> None:
        if not fut.cancelled() and fut.exception() is not None:
            self._on_send_error(out, fut.exception())

    def _on_send_error(self, out: Outgoing, exc: BaseException | None) -> None:
        """Send a record again, behind whatever was queued since.

        The copy may land after later chunks of the same request: the frontend sees the gap, moves the
        sequence, and drops the copy (server/streams.py). A final chunk that follows nothing is saved.
        """
        self.metrics.kafka_send_errors.inc()
        if out.tries + 1 < SEND_TRIES and self._producer is not None:
            log.warning("a reply record was not delivered (%r); sending it again", exc)
            task = asyncio.create_task(self._resend(out._replace(tries=out.tries + 1)))
            self._resends.add(task)
            task.add_done_callback(self._resends.discard)
            return
        log.warning("a reply record was not delivered (%r); giving up on it", exc)

    async def _resend(self, out: Outgoing) -> None:
        # With fresh metadata: Tansu refuses produces to a topic it re-created until the producer has it.
        assert self._producer is not None
        await self._producer.client.force_metadata_update()
        await self._outbox.put(out)

    # ---- heartbeat, health, KV events ----------------------------------------------------------

    def _ttl_s(self) -> float:
        return self.settings.heartbeat_interval_s * HEARTBEAT_MISSES

    def status(self) -> WorkerStatus:
        """This worker's registry record right now."""
        st = self.engine.stats()
        s = self.settings
        return WorkerStatus(
            worker_id=s.worker_id,
            model=s.served_model_name,
            engine=self.engine_name,
            block_size=st.block_size,
            total_blocks=st.total_blocks,
            max_model_len=st.max_model_len,
            started_at=self._started_at,
            heartbeat_at=time.time(),
            running=st.running,
            waiting=st.waiting,
            kv_usage=st.kv_usage,
            prefix_hit_rate=st.prefix_hit_rate,
            draining=self._draining,
            lora_adapters=adapters_of(self.engine),
            metrics_url=self._metrics_url,
            heartbeat_interval_s=s.heartbeat_interval_s,
        )

    async def _heartbeat_once(self) -> None:
        assert self._registry is not None
        if self._fatal is not None or self._left:
            return  # leaving: a heartbeat now would register a worker that can no longer serve
        status = self.status()
        self.metrics.observe(self.engine.stats(), len(self._inflight))
        # Kept so _leave can wait for it: a publish still in flight would re-register us after we left.
        self._publishing = asyncio.ensure_future(self._registry.publish(status, self._ttl_s()))
        await asyncio.shield(self._publishing)

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)  # the heartbeat period itself, not a wait for an event
            try:
                await self._heartbeat_once()
                if not self._redis_ok:
                    log.info("Redis is reachable again; heartbeats resumed")
                    self._redis_ok = True
            except Exception as exc:
                self.metrics.heartbeat_errors.inc()
                if self._redis_ok:
                    log.warning("heartbeat failed (%r); retrying every %.1fs", exc, interval)
                    self._redis_ok = False

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)  # check period
            await self.engine.check_health()

    async def _drain_kv_events(self) -> None:
        await self._kv.run(self.engine.kv_events())

