"""One worker: starts its parts in order (engine, outbox, inbox, pool, heartbeat), stops them in order, drains."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable

from aiokafka.errors import KafkaError

from bus.epochs import EpochTopics
from bus.produce import TrackingProducer, refresh_metadata
from bus.topics import RequestTopics, ensure_topics, retention
from kvstore.batch_store import BatchStore
from kvstore.bells import Bells, Coalesced
from kvstore.connect import redis_client
from kvstore.kv_index import KVIndex
from kvstore.registry import Registry
from schemas.kafka import ENGINE_DEAD, WORKER_STOPPED, Chunk, ErrorInfo, GenerateRequest
from schemas.names import RedisKeys, batch_results_topic, pool_topic
from schemas.settings import WorkerSettings
from workers.canary import Canary
from workers.engine import Engine, EngineDead
from workers.engine_control import EngineOps
from workers.heartbeat import Heartbeat
from workers.inbox import Inbox
from workers.kv_log import KVLog
from workers.kv_publisher import KVPublisher
from workers.lora import LoraControl
from workers.metrics import WorkerMetrics
from workers.outbox import Outbox
from workers.pool_consumer import PoolConsumer
from workers.reply_bells import ReplyBells
from workers.serving import Serving

log = logging.getLogger("ferry.worker")

READY_MARK = "ferry-worker-ready"
# The longest one client may take to close when the worker stops (an engine bounds its own steps below it).
CLOSE_STEP_S = 90.0


class Worker:
    """Owns the engine, the Kafka clients, the Redis client and the parts built on them; runs until told to stop."""

    def __init__(self, settings: WorkerSettings, engine: Engine, engine_name: str) -> None:
        s = self.settings = settings
        self.engine = engine
        self.engine_name = engine_name
        self.metrics = WorkerMetrics()
        self._redis = redis_client(s.redis)
        keys = RedisKeys(s.redis_prefix)
        index = self._index = KVIndex(self._redis, keys)
        self._kv = KVPublisher(index, s.worker_id, s.served_model_name, self.metrics)
        self._producer = TrackingProducer(bootstrap_servers=s.kafka, linger_ms=0, request_timeout_ms=10_000)
        self._outbox = Outbox(self._producer, self.metrics, s.reply_linger_ms / 1000)
        if s.pool_roll_s > 0:
            # Batch results go to the epoch current when they are sent, whatever the item named when it was
            # queued (hours ago, maybe): that epoch may be deleted by now (bus/epochs.py).
            results = EpochTopics(functools.partial(batch_results_topic, s.served_model_name), s.pool_roll_s)
            self._outbox.route_with(results.route)
        self.kv_log: KVLog | None = None  # the KV log (workers/kv_log.py), unless --no-kv-log
        bells = Bells(self._redis, keys) if s.doorbell else None
        # Frontends' replies readers sleep between tokens and are rung once this worker's records are in.
        self.reply_bells: ReplyBells | None = None
        notices: dict[str, Callable[[bytes], None]] = {}
        if bells is not None:
            results_ring = Coalesced(bells.publish_soon, keys.results_bell(s.served_model_name))
            self.reply_bells = ReplyBells(bells.publish_soon, (batch_results_topic(s.served_model_name), results_ring))
            self._outbox.on_acked = self.reply_bells.acked
            notices[keys.replies_asleep()] = self.reply_bells.heard
        self.serving = Serving(
            engine, self._outbox, self.metrics, s.worker_id, self._set_fatal, RequestTopics(s.request_roll_s), bells
        )
        engine.pace_outputs(self._outbox.room)
        self.heartbeat = Heartbeat(s, engine, engine_name, Registry(self._redis, keys), index, self.metrics,
                                   lambda: len(self.serving))  # fmt: skip
        if s.kv_log:
            ring = None
            if bells is not None:  # frontends' KV log readers sleep until a worker's records are in
                ring = functools.partial(bells.publish_soon, keys.kv_log_bell(s.served_model_name))
            self.kv_log = KVLog(self._producer, s.kafka, s.worker_id, s.served_model_name, self.heartbeat.started_at,
                                s.kv_log_roll_s, self.metrics, s.kafka_retention_bytes, ring=ring)  # fmt: skip
            self._kv.also = self.kv_log.add
        # LoRA load/unload from frontends (workers/lora.py); answers go to the asking frontend's topic.
        self.lora = LoraControl(engine, s.worker_id, self.heartbeat.once, self._outbox.send_ack)
        self.ops = EngineOps(engine, s.worker_id, self.heartbeat, index, self.serving.idle, s.drain_grace_s)
        self.lora.engine_ops = self.ops.apply
        self._inbox = Inbox(s, self.serving, self.lora, self.metrics, self._set_fatal, self._log_lost, notices)
        bell = self._inbox.doorbell
        self.metrics.inbox_doorbell.set_function(lambda: float(bell is not None and bell.armed))
        # A tiny real generation now and then: an engine that answers health checks but no longer steps.
        generated = lambda: self.metrics.registry.get_sample_value("ferry_worker_generated_tokens_total") or 0.0  # noqa: E731
        self.canary = Canary(engine, s.served_model_name, s.worker_id, self.serving.idle, generated,
                             s.canary_wait_s, s.canary_timeout_s)  # fmt: skip
        self.canary.paused = lambda: self.ops.sleeping
        self.pool: PoolConsumer | None = None  # batch work (workers/pool_consumer.py), unless --no-pool
        self._fatal: BaseException | None = None
        self._fatal_event = asyncio.Event()
        self.ready = asyncio.Event()  # set once registered and consuming
        self._closing: asyncio.Future[None] | None = None  # the clean-up, once run() ends

    @property
    def idle(self) -> asyncio.Event:
        """Set while no request is in flight."""
        return self.serving.idle

    async def run(self, shutdown: asyncio.Event) -> int:
        """Serve until `shutdown` is set, then drain; the return value is the process exit code."""
        s = self.settings
        self.heartbeat.metrics_url = self.metrics.serve(
            s.metrics_host, s.metrics_port, s.served_model_name, s.worker_id, s.role
        )
        self.heartbeat.readers.append(self._inbox.reader)
        tasks: list[asyncio.Task[None]] = []
        try:
            # Inside the try: a start that fails (broker down) must still stop the engine and the clients.
            await self.engine.start()
            await self._producer.start()
            await self._inbox.open()
            if s.pool and s.role != "prefill":  # batch items are whole sequences: not a prefill worker's
                batch_retention = retention(s.kafka_batch_retention_s, s.kafka_retention_bytes)
                if s.pool_roll_s <= 0:  # else frontends create the epochs; the pool consumer finds them
                    pool = {pool_topic(s.served_model_name): s.pool_partitions}
                    await ensure_topics(s.kafka, pool, batch_retention)
                store = BatchStore(self._redis, RedisKeys(s.redis_prefix))
                self.pool = PoolConsumer(s, self, store, self.metrics.registry)
                self._outbox.coalesce_with(self.pool.coalesce)  # batch sequences send their output once, whole
                await self.pool.start()
                self.heartbeat.readers.append(self.pool.reader)
            # A previous process under this id may have left index entries its cache no longer backs.
            await self._index.clear_worker(s.worker_id)
            # Register only once the inbox is positioned, so nothing routed to us can be missed.
            await self.heartbeat.once()
            self.ready.set()
            # A line for launchers to wait on, printed whatever the log level.
            print(f"{READY_MARK} {s.worker_id}", file=sys.stderr, flush=True)
            log.info(
                "worker %s ready: engine=%s model=%s topic=%s metrics=%s",
                s.worker_id, self.engine_name, s.served_model_name, self._inbox.topics.current(s.worker_id), self.heartbeat.metrics_url,
            )
            self._inbox.reader.run()
            tasks = [
                asyncio.create_task(self._guard("outbox", self._outbox.run())),
                asyncio.create_task(self._guard("heartbeat", self.heartbeat.run())),
                asyncio.create_task(self._guard("health", self.heartbeat.check_health())),
                asyncio.create_task(self._guard("kv-events", self._kv.run(self.engine.kv_events()))),
                # Replies topics rolled and deleted by frontends must not be asked for (re-created) again.
                asyncio.create_task(self._guard("topic-tracking", self._producer.forget_idle_forever())),
            ]
            if self.kv_log is not None:
                tasks.append(asyncio.create_task(self._guard("kv-log", self.kv_log.run())))
            if s.canary_wait_s > 0:
                tasks.append(asyncio.create_task(self._guard("canary", self.canary.run())))
            if self.pool is not None:
                self.pool.run()
            fatal = asyncio.create_task(self._fatal_event.wait())
            stop = asyncio.create_task(shutdown.wait())
            await asyncio.wait([stop, fatal], return_when=asyncio.FIRST_COMPLETED)
            fatal.cancel()
            stop.cancel()
            if self._fatal is not None:
                log.error("worker %s stopping after a fatal error: %r", s.worker_id, self._fatal)
                await self.heartbeat.leave()
                # Each sequence still here ends with a word that has its frontend move it at once; a dead or hung
                # (CanaryFailed) engine's also counts against the sequence (schemas/kafka.py, ATTEMPT_LOST).
                code = ENGINE_DEAD if self.engine_dead else WORKER_STOPPED
                await self.serving.fail_all(ErrorInfo(code, str(self._fatal), retriable=True))
                return 1
            await self._drain()
            return 0
        finally:
            # Shielded: a caller that gives up on the drain (a cancelled task) must not leave the Kafka
            # clients running; the clean-up then finishes in the background.
            self._closing = asyncio.ensure_future(self._close(tasks))
            await asyncio.shield(self._closing)

    async def _close(self, tasks: list[asyncio.Task[None]]) -> None:
        """Stop the loops and in-flight requests, hand queued chunks to the producer, close every client."""
        sender = tasks[0] if tasks else None
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await self._inbox.close()  # before anything else: read nothing more
        for t in tasks:
            if t is not sender:
                t.cancel()
        await asyncio.gather(*(t for t in tasks if t is not sender), return_exceptions=True)
        # Whatever still runs (a request that arrived after the drain, a caller that gave up on it) ends
        # without a last word: frontends move it once this worker has left the registry.
        await self.serving.abandon()
        if sender is not None:
            # Hand every queued chunk (final ones included) to the producer, whose stop() flushes them.
            await self._outbox.handed_over(5.0)
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        await self._outbox.close()
        # Nothing cancels this task (its caller holds it through a shield), so a CancelledError here comes from
        # inside a client whose own retries were cut short by the broker's absence: go on to the next one.
        closers: list[Callable[[], Awaitable[object]]] = [self._producer.stop, self.lora.close, self.engine.stop, self._redis.aclose, self.metrics.close]  # fmt: skip
        if self.pool is not None:
            pool = self.pool
            closers.insert(0, lambda: pool.close(commit=False))
        for close in closers:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                try:
                    # A client stuck on a dead peer (engine, broker) must not keep the process from exiting.
                    async with asyncio.timeout(CLOSE_STEP_S):
                        await close()
                except TimeoutError:
                    log.warning("worker %s: %r did not close within %.0fs", self.settings.worker_id, close, CLOSE_STEP_S)
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

    def _set_fatal(self, exc: BaseException) -> None:
        if self._fatal is None:
            self._fatal = exc
        self.heartbeat.stopped = True  # a worker that can no longer serve must not register again
        self._fatal_event.set()

    async def _log_lost(self) -> None:
        await refresh_metadata(self._producer)  # the replies it writes next must be seen

    async def _drain(self) -> None:
        """Leave routing at once, let in-flight requests finish within the grace period, commit."""
        s = self.settings
        self.heartbeat.draining = True
        if self.pool is not None:
            self.pool.stop_taking()
        # Heartbeats go on with draining=True: routers stop choosing us, while frontends still see us
        # alive and keep waiting for the requests we finish. We leave the registry only at the end.
        with contextlib.suppress(Exception):
            await self.heartbeat.once()
        log.info(
            "worker %s draining: %d request(s) in flight, grace %.0fs", s.worker_id, len(self.serving), s.drain_grace_s
        )
        deadline = time.monotonic() + s.drain_grace_s
        await self._until_idle(deadline)
        # Requests routed here before every router saw us draining may still arrive: read the inbox to its
        # end of the current poll, then let those finish too. Anything routed later stays unread and moves.
        await self._inbox.reader.finished(max(deadline - time.monotonic(), 0.0))
        if not await self._until_idle(deadline):
            # No last word, as from a dead worker: once this worker leaves the registry below, frontends
            # move the streams to other workers instead of telling their clients it stopped.
            log.warning(
                "worker %s: grace period over, handing %d request(s) back to be moved", s.worker_id, len(self.serving)
            )
            await self.serving.abandon()
        if not await self._outbox.flush(10.0):
            log.warning("could not flush every reply before leaving")
        with contextlib.suppress(KafkaError, TimeoutError):
            await self._inbox.reader.commit()
        if self.pool is not None:
            # Commit finished batch items and leave the group: the others take our partitions at once.
            await self.pool.close()
        await self.heartbeat.leave()

    async def _until_idle(self, deadline: float) -> bool:
        """Wait until nothing is in flight, up to the monotonic `deadline`; False if requests remain."""
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                await self.idle.wait()
        except TimeoutError:
            return False
        return True

    # ---- what the pool consumer needs of its host (workers/pool_consumer.py) ------------------------

    def start_request(self, req: GenerateRequest) -> asyncio.Task[None] | None:
        """Serve a batch item's request like a routed one; None if it is already running here."""
        if req.request_id in self.serving:
            return None
        return self.serving.start(req)

    def running_task(self, request_id: str) -> asyncio.Task[None] | None:
        """The task serving `request_id`, if it is running."""
        return self.serving.running(request_id)

    async def flush_replies(self, timeout_s: float) -> bool:
        """Wait until every reply chunk queued so far is acknowledged by the broker; False on timeout."""
        return await self._outbox.flush(timeout_s)

    def send_final(self, req: GenerateRequest, chunk: Chunk) -> None:
        """Queue the last chunk of a request that is not run here."""
        self._outbox.send_final_nowait(req, chunk)

    @property
    def engine_dead(self) -> bool:
        """True once the engine died or hung (a CanaryFailed is an EngineDead too)."""
        return isinstance(self._fatal, EngineDead)

    @property
    def failed(self) -> bool:
        """True once a fatal error stopped this worker."""
        return self._fatal is not None

    def fail(self, exc: BaseException) -> None:
        """A background part of the worker died (the pool's reader): the worker stops."""
        self._set_fatal(exc)
