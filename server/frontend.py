"""One frontend process's parts, built and started together, stopped in order: the started `Frontend`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.produce import TrackingProducer
from bus.topics import RequestTopics, ensure_topics, retention
from kvstore.bells import Bells
from kvstore.connect import redis_client
from kvstore.kv_index import KVIndex
from kvstore.load import LoadBoard
from kvstore.registry import Registry, reachable_host
from kvstore.resume_store import ResumeStore
from schemas.names import RedisKeys, admin_topic, reply_topic
from schemas.settings import FrontendSettings
from schemas.status import FrontendStatus
from server.delivery import RequestLog
from server.dispatcher import Dispatcher
from server.errors import APIError, model_not_found
from server.generation import Services
from server.kafka_io import ReplyDemux
from server.kv_indexer import KVIndexer
from server.logprobs import LogprobFormatter
from server.lora_admin import AckInbox, LoraAdmin
from server.losses import Migrations
from server.metrics import FrontendMetrics
from server.model_files import ModelFiles
from server.pool import WorkerPool
from server.preprocess import Preprocessor
from server.reply_bell import RepliesBell
from server.router import Router
from server.templates import chat_template_text

log = logging.getLogger("ferry.frontend")

# A shutdown step slower than this is logged: a frontend that takes long to exit says what it waited on.
SLOW_STOP_S = 2.0


@dataclass
class Frontend:
    """Everything a started frontend runs; built by `start_frontend`, so no part is ever missing."""

    settings: FrontendSettings
    metrics: FrontendMetrics
    model: ModelFiles
    pre: Preprocessor
    fmt: LogprobFormatter
    svc: Services
    lora_admin: LoraAdmin
    background: Background
    indexer: KVIndexer | None = None  # the KV log's indexer (server/kv_indexer.py), unless --no-kv-log
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def pool(self) -> WorkerPool:
        """The live workers, from the registry."""
        return self.svc.pool

    def max_model_len(self, model: str) -> int:
        """Context length of `model`: 404 if not served here, 503 if no worker is up."""
        if model != self.settings.served_model_name:
            # A LoRA adapter is asked for by its name, as with vLLM; live workers holding it serve it.
            adapter = self.pool.adapters().get(model)
            if adapter is None:
                raise model_not_found(model)
            return adapter[1]
        lens = self.pool.models()
        if model not in lens:
            raise APIError(
                503, f"No live worker serves the model `{model}` right now.", code="no_workers", retry_after=1
            )
        return lens[model]


async def _timed(what: str, stop: Callable[[], Awaitable[Any]]) -> None:
    """Run one shutdown step; one that is slow is named while it runs (it may never end) and when done.

    A step that fails is logged and the shutdown goes on: one client that cannot close cleanly (the broker
    is down) must not keep the others open or fail the whole exit.
    """
    t0 = time.monotonic()
    step = asyncio.ensure_future(stop())
    done, _ = await asyncio.wait({step}, timeout=SLOW_STOP_S)
    if not done:
        log.warning("still stopping the %s after %.0fs", what, SLOW_STOP_S)
    try:
        await step
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            raise  # the shutdown itself is being cut short
        # aiokafka's stop() lets out the cancellation of its own retry loop when the broker is away.
        log.warning("stopping the %s was cut short inside it (the broker is away?)", what)
    except Exception as exc:
        log.warning("stopping the %s failed: %r", what, exc)
    if not done:
        log.warning("stopped the %s after %.1fs", what, time.monotonic() - t0)


class Background:
    """Best-effort work in the background (cancels, index sweeps), each task kept until it is done."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Future[None]] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run `coro`; a failure is logged."""

        async def guarded() -> None:
            try:
                await coro
            except Exception as exc:
                log.warning("background task failed: %r", exc)

        task = asyncio.ensure_future(guarded())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)



async def _cancel_all(tasks: set[asyncio.Task[None]]) -> None:
    """Cancel resumable streams still running without a client (each cancels its sequences)."""
    pending = list(tasks)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


@contextlib.asynccontextmanager
async def start_frontend(settings: FrontendSettings, metrics: FrontendMetrics) -> AsyncIterator[Frontend]:
    """Connect to Redis and Kafka, start the registry view and the readers; stop everything on exit."""
    s = settings
    template = chat_template_text(s.chat_template) if s.chat_template else None
    model = ModelFiles.load(Path(s.model_path), s.served_model_name, template)
    redis = redis_client(s.redis)
    keys = RedisKeys(s.redis_prefix)
    index = KVIndex(redis, keys)
    board = LoadBoard(redis, keys)
    router = Router(s, metrics, index)
    bells = Bells(redis, keys) if s.doorbell else None
    demux = ReplyDemux(
        s.kafka, reply_topic(s.frontend_id), s.kafka_fetch_wait_ms,
        roll_records=s.replies_roll_records, retain_s=s.resume_ttl_s, metrics=metrics,
        configs=retention(2 * s.resume_ttl_s, s.kafka_retention_bytes), doorbell=s.doorbell,
        workers_bell=None if bells is None else RepliesBell(s.redis, keys, s.frontend_id, bells),
    )  # fmt: skip
    producer = TrackingProducer(bootstrap_servers=s.kafka, linger_ms=0, request_timeout_ms=10_000)
    short = retention(s.kafka_request_retention_s, s.kafka_retention_bytes)  # request and admin topics
    dispatcher = Dispatcher(producer, s.kafka_timeout_s, metrics, RequestTopics(s.request_roll_s), short, s.kafka, bells)
    dispatcher.on_note = demux.wake
    replies_bell = demux.workers_bell
    metrics.replies_doorbell.set_function(lambda: float(replies_bell is not None and replies_bell.armed))
    background = Background()
    # Where a lost worker or a lost replies log is answered (server/migration.py).
    migrations = Migrations(
        demux, dispatcher, producer, router, index, metrics, s.migration_limit,
        grace_s=s.heartbeat_interval_s, spawn=background.spawn,
    )  # fmt: skip
    demux.on_reset = migrations.log_lost

    registry = Registry(redis, keys)
    base_url = f"http://{reachable_host(s.host)}:{s.port}"
    me = FrontendStatus(s.frontend_id, s.served_model_name, base_url, f"{base_url}/metrics", time.time())

    async def exchange_load() -> None:
        router.remote = await board.exchange(s.frontend_id, router.local, 3 * s.heartbeat_interval_s)
        # Announced with every refresh, so Prometheus service discovery lists exactly the live frontends.
        me.heartbeat_at = time.time()
        await registry.announce_frontend(me, 3 * s.heartbeat_interval_s)
        await metrics.record_lag(demux.reader)

    pool = WorkerPool(
        registry, s.heartbeat_interval_s / 2, metrics, migrations.worker_gone, exchange_load,
        s.max_queued_requests, heartbeat_s=s.heartbeat_interval_s,
    )  # fmt: skip
    requests = RequestLog(s.kafka)
    requests.topic_of = dispatcher.topic_of
    # Adapter loads are rare and slow anyway: no need to poll their answers every few ms.
    acks = AckInbox(s.kafka, admin_topic(s.frontend_id), max(s.kafka_fetch_wait_ms, 100))
    svc = Services(
        frontend_id=s.frontend_id, pool=pool, router=router, dispatcher=dispatcher, demux=demux,
        metrics=metrics, migrations=migrations, requests=requests,
        resume=ResumeStore(redis, keys, s.resume_ttl_s, s.resume_grace_s),
        request_timeout_s=s.request_timeout_s, keepalive_s=s.sse_keepalive_s, busy_wait_s=s.busy_wait_s,
        migration_limit=s.migration_limit, delivery_check_s=s.delivery_check_s,
        resume_grace_s=s.resume_grace_s,
    )  # fmt: skip
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(_timed, "Redis client", redis.aclose)
        # Registered before start: a start that fails (broker down) must still close the client.
        stack.push_async_callback(_timed, "Kafka producer", producer.stop)
        await producer.start()
        await demux.start()
        stack.push_async_callback(_timed, "reply consumer", demux.stop)
        stack.push_async_callback(_timed, "request log reader", requests.stop)
        await requests.start()
        # Withdrawn after the view stops refreshing (which would announce it again).
        stack.push_async_callback(_timed, "frontend announcement", lambda: registry.withdraw_frontend(s.frontend_id))
        await pool.start()
        stack.push_async_callback(_timed, "worker registry view", pool.stop)
        indexer = None
        if s.kv_log and s.kv_events:
            indexer = KVIndexer(s, redis, keys, index, lambda: pool.workers, metrics)
            await indexer.start()
            router.standby = indexer  # answers the router once caught up (--kv-lookup mirror), and while Redis lost the index or is unreachable
            stack.push_async_callback(_timed, "KV indexer", indexer.stop)
        await ensure_topics(s.kafka, {acks.topic: 1}, short)  # with its retention, before the reader makes it
        await acks.start()
        stack.push_async_callback(_timed, "admin ack reader", acks.stop)
        stack.push_async_callback(_timed, "unattended streams", lambda: _cancel_all(svc.detached))
        fe = Frontend(
            settings=s, metrics=metrics, model=model, pre=Preprocessor(model, s.tokenize_threshold_chars, s.tool_call_parser),
            fmt=LogprobFormatter(model), svc=svc, lora_admin=LoraAdmin(acks, producer, pool, s.served_model_name, bells=bells), background=background,
            indexer=indexer,
        )  # fmt: skip
        log.info(
            "frontend %s serving %s on http://%s:%d (policy %s, %d worker(s) live)",
            s.frontend_id, s.served_model_name, s.host, s.port, s.router_policy, len(pool.workers),
        )
        yield fe
        log.info("frontend %s stopping", s.frontend_id)
