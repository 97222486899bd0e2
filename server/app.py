"""The frontend's Starlette app: routes, one lifespan that owns every background component."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvstore.kv_index import KVIndex
from kvstore.load import LoadBoard
from kvstore.registry import Registry
from kvstore.resume_store import ResumeStore
from schemas.names import RedisKeys, admin_topic, reply_topic
from schemas.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    chat_request_decoder,
    completion_request_decoder,
    json_encoder,
)
from schemas.settings import FrontendSettings
from schemas.status import WorkerStatus
from schemas.streams import StreamRecord
from server import admin
from server.admin import AckInbox, LoraAdmin
from server.auth import APIKeyAuth, parse_keys
from server.batch.routes import routes as batch_routes
from server.batch.service import BatchService
from server.delivery import RequestLog
from server.errors import APIError, from_validation_error, model_not_found
from server.generation import Generation, Services, new_id
from server.kafka_io import Dispatcher, ReplyDemux
from server.metrics import FrontendMetrics
from server.migration import Migrations
from server.model_files import ModelFiles
from server.openapi import document_bytes
from server.pool import WorkerPool
from server.preprocess import Preprocessor
from server.responses import (
    LogprobFormatter,
    chat_full,
    chat_stream,
    completion_full,
    completion_stream,
)
from server.resume import Replay, parse_last_event_id
from server.router import Router
from server.sse import SSEResponse

log = logging.getLogger("ferry.frontend")

T = TypeVar("T")



# A shutdown step slower than this is logged: a frontend that takes long to exit says what it waited on.
SLOW_STOP_S = 2.0


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

class Frontend:
    """Everything one frontend process runs, started and stopped together."""

    def __init__(self, settings: FrontendSettings) -> None:
        self.settings = settings
        self.metrics = FrontendMetrics()
        self.model = ModelFiles.load(Path(settings.model_path), settings.served_model_name)
        self.pre = Preprocessor(self.model, settings.tokenize_threshold_chars)
        self.fmt = LogprobFormatter(self.model)
        self.started = int(time.time())
        self.inflight = 0
        self.draining = False  # set on SIGTERM (launch/frontend.py): finish open work, take no new
        self.svc: Services | None = None
        self.lora_admin: LoraAdmin | None = None  # LoRA load/unload (server/admin.py), once running
        self.background: set[asyncio.Future[None]] = set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Connect to Redis and Kafka, start the registry view and reply consumer; undo on exit."""
        s = self.settings
        redis = aioredis.from_url(s.redis, socket_timeout=2.0, socket_connect_timeout=2.0)
        keys = RedisKeys(s.redis_prefix)
        registry = Registry(redis, keys)
        index = KVIndex(redis, keys)
        board = LoadBoard(redis, keys)
        self.router = router = Router(s, self.metrics, index)
        demux = ReplyDemux(
            s.kafka, reply_topic(s.frontend_id), s.kafka_fetch_wait_ms,
            roll_records=s.replies_roll_records, retain_s=s.resume_ttl_s, metrics=self.metrics,
        )

        producer = AIOKafkaProducer(bootstrap_servers=s.kafka, linger_ms=0, request_timeout_ms=10_000)
        dispatcher = Dispatcher(producer, s.kafka_timeout_s, self.metrics)
        # Where a lost worker or a lost replies log is answered (server/migration.py).
        migrations = Migrations(
            demux, dispatcher, producer, router, index, self.metrics, s.migration_limit,
            grace_s=s.heartbeat_interval_s, spawn=self._spawn,
        )  # fmt: skip
        demux.on_reset = migrations.log_lost

        async def exchange_load() -> None:
            router.remote = await board.exchange(s.frontend_id, router.local, 3 * s.heartbeat_interval_s)

        pool = WorkerPool(
            registry, s.heartbeat_interval_s / 2, self.metrics, migrations.worker_gone, exchange_load,
            s.max_queued_requests, heartbeat_s=s.heartbeat_interval_s,
        )  # fmt: skip
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(_timed, "Redis client", redis.aclose)
            # Registered before start: a start that fails (broker down) must still close the client.
            stack.push_async_callback(_timed, "Kafka producer", producer.stop)
            await producer.start()
            await demux.start()
            stack.push_async_callback(_timed, "reply consumer", demux.stop)
            requests = RequestLog(s.kafka)
            stack.push_async_callback(_timed, "request log reader", requests.stop)
            await requests.start()
            await pool.start()
            stack.push_async_callback(_timed, "worker registry view", pool.stop)
            # Adapter loads are rare and slow anyway: no need to poll their answers every few ms.
            acks = AckInbox(s.kafka, admin_topic(s.frontend_id), max(s.kafka_fetch_wait_ms, 100))
            await acks.start()
            stack.push_async_callback(_timed, "admin ack reader", acks.stop)
            self.lora_admin = LoraAdmin(acks, producer, pool, s.served_model_name)
            self.svc = Services(
                frontend_id=s.frontend_id,
                pool=pool,
                router=self.router,
                dispatcher=dispatcher,
                demux=demux,
                metrics=self.metrics,
                migrations=migrations,
                request_timeout_s=s.request_timeout_s,
                keepalive_s=s.sse_keepalive_s,
                busy_wait_s=s.busy_wait_s,
                migration_limit=s.migration_limit,
                requests=requests,
                delivery_check_s=s.delivery_check_s,
                resume=ResumeStore(redis, keys, s.resume_ttl_s, s.resume_grace_s),
                resume_grace_s=s.resume_grace_s,
            )
            stack.push_async_callback(_timed, "unattended streams", self._stop_detached)
            log.info(
                "frontend %s serving %s on http://%s:%d (policy %s, %d worker(s) live)",
                s.frontend_id, s.served_model_name, s.host, s.port, s.router_policy, len(pool.workers),
            )
            yield
            log.info("frontend %s stopping", s.frontend_id)

    async def _stop_detached(self) -> None:
        """Cancel resumable streams still running without a client (each cancels its sequences)."""
        if self.svc is None:
            return
        tasks = list(self.svc.detached)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- helpers ---------------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> None:
        """Run best-effort work in the background, keeping a reference until it is done."""

        async def guarded() -> None:
            try:
                await coro
            except Exception as exc:
                log.warning("background task failed: %r", exc)

        task = asyncio.ensure_future(guarded())
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def body(self, request: Request) -> bytes:
        """The request body, refusing anything over the size limit without reading it all."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"Request body larger than {limit} bytes.", code="body_too_large")
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise APIError(413, f"Request body larger than {limit} bytes.", code="body_too_large")
            parts.append(part)
        return b"".join(parts)

    def max_model_len(self, model: str) -> int:
        """Context length of `model`: 404 if not served here, 503 if no worker is up."""
        if model != self.settings.served_model_name:
            # A LoRA adapter is asked for by its name, as with vLLM; live workers holding it serve it.
            adapter = self.svc.pool.adapters().get(model) if self.svc else None
            if adapter is None:
                raise model_not_found(model)
            return adapter[1]
        lens = self.svc.pool.models() if self.svc else {}
        if model not in lens:
            raise APIError(
                503, f"No live worker serves the model `{model}` right now.", code="no_workers", retry_after=1
            )
        return lens[model]

    def release(self) -> None:
        """A request left (its response, streamed or not, is over)."""
        self.inflight -= 1
        self.metrics.inflight.dec()

    def admit(self) -> None:
        """Refuse work over the concurrency limit."""
        if self.draining:
            raise APIError(
                503, "This frontend is shutting down; try again shortly.", code="shutting_down", retry_after=1
            )
        # `inflight` already counts this request.
        if self.inflight > self.settings.max_concurrent_requests:
            raise APIError(503, "The server is at capacity; try again shortly.", code="overloaded", retry_after=1)


def _decode(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise from_validation_error(exc) from None


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


class _HeldInFlight:
    """A streamed response that keeps its request's place among those in flight until the stream ends."""

    def __init__(self, response: SSEResponse, fe: Frontend) -> None:
        self.response = response
        self.status_code = 200
        self._fe = fe

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream, then give the place back whatever happened."""
        try:
            await self.response(scope, receive, send)
        finally:
            self._fe.release()


def _handler(endpoint: str) -> Callable[[Callable[[Frontend, Request], Awaitable[Response]]], Any]:
    """Wrap a route: errors become OpenAI bodies, in-flight and status are counted."""

    def wrap(fn: Callable[[Frontend, Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def route(request: Request) -> Response:
            fe: Frontend = request.app.state.frontend
            fe.inflight += 1
            fe.metrics.inflight.inc()
            t0 = time.perf_counter()
            status = 500
            held = False
            try:
                response = await fn(fe, request)
                status = response.status_code if isinstance(response, Response) else 200
                if isinstance(response, SSEResponse):
                    # A stream is in flight until its last event is sent, not when its handler returns.
                    held = True
                    return _HeldInFlight(response, fe)  # type: ignore[return-value]
                return response
            except APIError as err:
                status = err.status
                return err.response()
            except ClientDisconnect:
                status = 499
                return Response(status_code=499)
            finally:
                if not held:
                    fe.release()
                fe.metrics.requests.labels(endpoint, str(status)).inc()
                if status == 200:
                    fe.metrics.e2e.observe(time.perf_counter() - t0)

        return route

    return wrap


def _headers(gen: Generation) -> dict[str, str]:
    return {
        "x-request-id": gen.id,
        "x-ferry-worker": ",".join(gen.worker_ids),
        "x-ferry-predicted-cached-blocks": str(gen.predicted_cached_blocks),
    }


def _wants_resumable(request: Request) -> bool:
    return request.headers.get("x-ferry-resumable", "").strip().lower() in ("1", "true", "yes")


async def _start(fe: Frontend, model: str, prepared: Any, prefix: str, resumable: bool = False) -> Generation:
    assert fe.svc is not None
    fe.metrics.prompt_tokens.inc(sum(len(p) for p in prepared.prompts))
    gen = Generation(fe.svc, model, prepared, new_id(prefix), resumable=resumable and prepared.stream)
    await gen.start()
    return gen


async def _remember(fe: Frontend, gen: Generation, kind: Any, echo: bool) -> dict[str, str]:
    """Save a resumable stream's record; headers telling the client whether it can resume."""
    if not gen.resumable:
        return {}
    assert fe.svc is not None and fe.svc.resume is not None
    spec = gen.spec
    record = StreamRecord(
        topic=gen.reply_topic, offset=gen.first_offset, kind=kind, model=gen.model, created=gen.created,
        n=spec.n, prompt_lens=spec.prompt_lens, include_usage=spec.include_usage, logprobs=spec.logprobs,
        echo_texts=spec.prompt_texts if echo else [], frontend_id=fe.settings.frontend_id,
    )
    try:
        async with asyncio.timeout(fe.settings.kafka_timeout_s):
            await fe.svc.resume.save(gen.id, record)
    except Exception as exc:
        # Still served, just not resumable: it is cancelled when the client leaves, as usual.
        log.warning("could not save the resume record of %s (%r); it will not be resumable", gen.id, exc)
        gen.resumable = False
        return {"x-ferry-resumable": "0"}
    return {"x-ferry-resumable": "1"}


@_handler("chat")
async def chat_completions(fe: Frontend, request: Request) -> Response:
    """POST /v1/chat/completions."""
    fe.admit()
    req: ChatCompletionRequest = _decode(chat_request_decoder, await fe.body(request))
    max_len = fe.max_model_len(req.model)
    with fe.metrics.tokenize_seconds.time():
        prepared = await fe.pre.chat(req, max_len)
    if fe.settings.log_prompts:
        log.info("chat prompt: %r", prepared.prompt_texts[0])  # only when asked: prompts are private
    gen = await _start(fe, req.model, prepared, "chatcmpl", _wants_resumable(request))
    if prepared.stream:
        headers = {**_headers(gen), **await _remember(fe, gen, "chat", False)}
        return SSEResponse(chat_stream(gen, fe.fmt), headers)  # type: ignore[return-value]
    try:
        result = await _until_disconnect(request, chat_full(gen, fe.fmt))
    finally:
        await gen.close()
    return Response(json_encoder.encode(result), headers=_headers(gen), media_type="application/json")


@_handler("completions")
async def completions(fe: Frontend, request: Request) -> Response:
    """POST /v1/completions."""
    fe.admit()
    req: CompletionRequest = _decode(completion_request_decoder, await fe.body(request))
    max_len = fe.max_model_len(req.model)
    with fe.metrics.tokenize_seconds.time():
        prepared = await fe.pre.completion(req, max_len)
    if fe.settings.log_prompts:
        log.info("completion prompts: %r", prepared.prompt_texts)  # only when asked: prompts are private
    gen = await _start(fe, req.model, prepared, "cmpl", _wants_resumable(request))
    if prepared.stream:
        headers = {**_headers(gen), **await _remember(fe, gen, "completion", req.echo)}
        return SSEResponse(completion_stream(gen, fe.fmt, req.echo), headers)  # type: ignore[return-value]
    try:
        result = await _until_disconnect(request, completion_full(gen, fe.fmt, req.echo))
    finally:
        await gen.close()
    return Response(json_encoder.encode(result), headers=_headers(gen), media_type="application/json")


@_handler("resume")
async def resume_stream(fe: Frontend, request: Request) -> Response:
    """GET /v1/chat/completions/{id}/stream, /v1/completions/{id}/stream: the rest of a resumable stream.

    Sends the events after `Last-Event-ID` (all of them without it), then follows the request live.
    """
    assert fe.svc is not None and fe.svc.resume is not None
    rid = request.path_params["id"]
    kind = "chat" if request.url.path.startswith("/v1/chat/") else "completion"
    after = parse_last_event_id(request.headers.get("last-event-id"))
    if after < -1:
        raise APIError(400, "Last-Event-ID must be the integer id of an event of this stream.",
                       param="Last-Event-ID", code="invalid_last_event_id")
    try:
        async with asyncio.timeout(fe.settings.kafka_timeout_s):
            record = await fe.svc.resume.load(rid)
    except Exception as exc:
        raise APIError(503, "Resumable streams are unavailable right now (Redis).", code="redis_unavailable",
                       retry_after=2) from exc
    if record is None or record.kind != kind:
        raise APIError(404, f"No resumable stream `{rid}` (unknown, not resumable, or expired).",
                       code="stream_not_found")
    s = fe.settings
    replay = Replay(rid, record, s.kafka, fe.svc.resume, s.sse_keepalive_s, s.request_timeout_s,
                    s.resume_grace_s, s.kafka_fetch_wait_ms)
    try:
        async with asyncio.timeout(s.kafka_timeout_s):
            await replay.start()
    except Exception as exc:
        await replay.close()
        raise APIError(503, "The message broker is unavailable; try again shortly.", code="broker_unavailable",
                       retry_after=2) from exc
    events = (chat_stream(replay, fe.fmt, after) if kind == "chat"
              else completion_stream(replay, fe.fmt, bool(record.echo_texts), after))
    return SSEResponse(events, {"x-request-id": rid, "x-ferry-resumable": "1"})  # type: ignore[return-value]


@_handler("models")
async def list_models(fe: Frontend, request: Request) -> Response:
    """GET /v1/models: the model this frontend serves, with its context length once a worker is up."""
    lens = fe.svc.pool.models() if fe.svc else {}
    name = fe.settings.served_model_name
    card = ModelCard(id=name, created=fe.started, root=str(fe.model.path), max_model_len=lens.get(name))
    adapters = fe.svc.pool.adapters() if fe.svc else {}
    paths = fe.lora_admin.paths if fe.lora_admin else {}
    # LoRA adapters as vLLM lists them: their own entry, `parent` = the base model.
    cards = [card] + [
        ModelCard(id=a, created=fe.started, root=paths.get(a), parent=base, max_model_len=n)
        for a, (base, n) in sorted(adapters.items())
        if base == name
    ]
    return Response(json_encoder.encode(ModelList(data=cards)), media_type="application/json")


async def health(request: Request) -> Response:
    """GET /health: the process is alive and can still answer requests (503 once its reply consumer died)."""
    fe: Frontend = request.app.state.frontend
    failed = fe.svc.demux.failed if fe.svc else None
    if failed is not None:
        # Nothing this process sends out can come back: a supervisor should restart it.
        return JSONResponse({"status": "failed", "reason": f"reply consumer failed: {failed!r}"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """GET /ready: 200 once a live worker serves the model (`?model=` or this frontend's)."""
    fe: Frontend = request.app.state.frontend
    model = request.query_params.get("model", fe.settings.served_model_name)
    workers = fe.svc.pool.live(model) if fe.svc else []
    body = {"ready": bool(workers), "model": model, "workers": [w.worker_id for w in workers]}
    if fe.draining:
        body = {**body, "ready": False, "draining": True}
    return JSONResponse(body, status_code=200 if workers and not fe.draining else 503)


async def metrics(request: Request) -> Response:
    """GET /metrics in the Prometheus text format."""
    fe: Frontend = request.app.state.frontend
    return Response(generate_latest(fe.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the API's OpenAPI 3.1 document, generated from the request and response Structs."""
    return Response(request.app.state.openapi, media_type="application/json")


async def not_found(request: Request, exc: Exception) -> Response:
    """Unknown paths get an OpenAI-style 404 too."""
    return APIError(404, f"Unknown path {request.url.path}", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    """Wrong method on a known path."""
    return APIError(405, f"Method {request.method} not allowed on {request.url.path}", code="method_not_allowed").response()


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug still answers in OpenAI's shape (Starlette logs the traceback after this response)."""
    return APIError(500, "The server had an error while processing your request.", code="internal_error").response()


def create_app(settings: FrontendSettings) -> Starlette:
    """The ASGI app of one frontend."""
    fe = Frontend(settings)
    api_keys = parse_keys(settings.api_keys)
    if not api_keys and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without API keys: anyone who can reach it may use it", settings.host)
    if api_keys and not settings.admin_key:
        log.info("API keys set but no admin key: /v1/admin/* is closed to every caller")

    batch = BatchService(settings)  # the Files and Batches API (server/batch/)

    def batch_workers() -> list[WorkerStatus]:
        return fe.svc.pool.live(settings.served_model_name) if fe.svc else []

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with fe.running(), batch.running(fe.pre, fe.fmt, batch_workers):
            yield

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions/{id}/stream", resume_stream, methods=["GET"]),
            Route("/v1/completions/{id}/stream", resume_stream, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi_json, methods=["GET"]),
            *batch_routes(),
            *admin.routes(_handler),
        ],
        lifespan=lifespan,
        exception_handlers={404: not_found, 405: method_not_allowed, Exception: internal_error},
        middleware=[Middleware(APIKeyAuth, api_keys=api_keys, admin_key=settings.admin_key)],
    )
    app.state.frontend = fe
    app.state.batch = batch
    app.state.openapi = document_bytes(settings.served_model_name, bool(api_keys or settings.admin_key))
    return app
