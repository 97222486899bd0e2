"""HTTP plumbing of the frontend's routes: admission, body limits, errors as OpenAI bodies, disconnects."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from schemas.openai import json_encoder
from schemas.tenants import UsageRecord
from server.errors import APIError, from_validation_error
from server.frontend import Frontend
from server.metrics import FrontendMetrics
from server.preprocess import Prepared
from server.sse import SSEResponse
from server.tenants_fair import FairQueue, Turn
from server.tenants_quota import Lease, QuotaGate
from server.tenants_usage import UsagePublisher

T = TypeVar("T")
Handler = Callable[[Frontend, Request], Awaitable[Response]]


class Gate:
    """Requests in flight and whether new ones are taken; exists before the frontend starts (SIGTERM)."""

    def __init__(self, max_concurrent: int, metrics: FrontendMetrics) -> None:
        self._max = max_concurrent
        self._metrics = metrics
        self.inflight = 0
        self.draining = False  # set on SIGTERM (launch/frontend.py): finish open work, take no new

    def enter(self) -> None:
        """A request arrived (counted even if it is refused)."""
        self.inflight += 1
        self._metrics.inflight.inc()

    def leave(self) -> None:
        """A request left (its response, streamed or not, is over)."""
        self.inflight -= 1
        self._metrics.inflight.dec()

    def admit(self) -> None:
        """Refuse work while draining or over the concurrency limit."""
        if self.draining:
            raise APIError(
                503, "This frontend is shutting down; try again shortly.", code="shutting_down", retry_after=1
            )
        # `inflight` already counts this request.
        if self.inflight > self._max:
            raise APIError(
                503, "The server is at capacity; try again shortly.", code="overloaded", retry_after=1
            )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing anything over `limit` bytes without reading it all."""
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


def decode(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """Decode a JSON body; a violation is a 400 naming the field."""
    try:
        return decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise from_validation_error(exc) from None
    except RecursionError:
        # Fields that hold any JSON (a tool's parameters schema) could otherwise nest until msgspec gives up.
        raise APIError(400, "The JSON body is nested too deeply.", code="invalid_json") from None


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
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


async def admit_tenant(request: Request, prompt_tokens: int) -> dict[str, str]:
    """Charge the request to its tenant's quota (429 over it); the `x-ratelimit-*` headers for its response.

    The tenant's place is given back when the response ends, whatever ends it (`route`, `_HeldInFlight`).
    """
    quota: QuotaGate | None = getattr(request.app.state, "quota", None)
    tenant: str | None = getattr(request.state, "tenant", None)
    if quota is None or tenant is None:
        return {}  # no tenants, or the admin key (not metered)
    lease = await quota.admit(tenant, prompt_tokens)
    request.state.lease = lease
    request.app.state.frontend.metrics.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
    fair: FairQueue | None = getattr(request.app.state, "fair", None)
    if fair is not None:
        fair.sync(lease.counters)
        # While workers are busy: in weighted-fair order. The turn carries the request's engine priority.
        request.state.fair_turn = await fair.wait_turn(tenant, prompt_tokens)
    return lease.headers


def with_turn(request: Request, prepared: Prepared) -> Prepared:
    """The request with its tenant's engine priority (server/tenants_fair.py) when the fair queue gave it one;
    the body's own `priority` can only lower it further, never raise it above the tenant's standing."""
    turn: Turn | None = getattr(request.state, "fair_turn", None)
    if turn is None:
        return prepared
    priority = turn.priority + max(0, prepared.priority)
    return dataclasses.replace(prepared, priority=priority, overtake=turn.overtake)


async def _end_tenant(request: Request, status: int) -> None:
    lease: Lease | None = getattr(request.state, "lease", None)
    if lease is None or lease.released:
        return
    count = getattr(request.state, "completion_tokens", None)
    lease.completion_tokens = count() if count is not None else 0
    cached = getattr(request.state, "cached_tokens", None)
    metrics: FrontendMetrics = request.app.state.frontend.metrics
    metrics.tenant_tokens.labels(lease.tenant, "completion").inc(lease.completion_tokens)
    metrics.tenant_requests.labels(lease.tenant, "ok" if status < 400 else "error").inc()
    fair: FairQueue | None = getattr(request.app.state, "fair", None)
    if fair is not None:
        fair.charge(lease.tenant, lease.completion_tokens)
        turn: Turn | None = getattr(request.state, "fair_turn", None)
        if turn is not None:
            fair.done(turn)
    usage: UsagePublisher | None = getattr(request.app.state, "usage", None)
    if usage is not None:
        usage.publish(
            UsageRecord(
                at=time.time(), tenant=lease.tenant, key_id=getattr(request.state, "key_id", ""),
                model=getattr(request.state, "model", ""), errors=int(status >= 400),
                prompt_tokens=lease.prompt_tokens, completion_tokens=lease.completion_tokens,
                cached_tokens=cached() if cached is not None else 0,
            )
        )  # fmt: skip
    # Shielded: a cancelled request still gives its concurrency slot back.
    await asyncio.shield(request.app.state.quota.release(lease))


class _HeldInFlight:
    """A streamed response that keeps its request's place among those in flight until the stream ends."""

    def __init__(self, response: SSEResponse, gate: Gate, request: Request) -> None:
        self.response = response
        self.status_code = 200
        self._gate = gate
        self._request = request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the stream, then give the place back whatever happened."""
        try:
            await self.response(scope, receive, send)
        finally:
            self._gate.leave()
            await _end_tenant(self._request, 200)


def route(
    endpoint: str, admit: bool = False
) -> Callable[[Handler], Callable[[Request], Awaitable[Response]]]:
    """Wrap a handler: errors become OpenAI bodies; in-flight requests, status and latency are counted.

    With `admit`, the request is refused (503) while draining or over the concurrency limit.
    """

    def wrap(fn: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            fe: Frontend = request.app.state.frontend
            gate: Gate = request.app.state.gate
            gate.enter()
            # Latency counts from here (server/generation.py observes it when the response ends).
            request.state.arrived = time.perf_counter()
            status = 500
            code = "internal_error"
            held = False
            try:
                if admit:
                    gate.admit()
                response = await fn(fe, request)
                status = response.status_code if isinstance(response, Response) else 200
                if isinstance(response, SSEResponse):
                    # A stream is in flight until its last event is sent, not when its handler returns.
                    held = True
                    return _HeldInFlight(response, gate, request)  # type: ignore[return-value]
                return response
            except APIError as err:
                status, code = err.status, err.code or str(err.status)
                return err.response()
            except ClientDisconnect:
                status, code = 499, "client_disconnected"
                return Response(status_code=499)
            finally:
                if not held:
                    gate.leave()
                    await _end_tenant(request, status)
                fe.metrics.requests.labels(endpoint, str(status)).inc()
                if status >= 400 and not getattr(request.state, "error_counted", False):
                    fe.metrics.errors.labels(getattr(request.state, "model", ""), code, "request").inc()

        return handle

    return wrap


def json_response(body: object, headers: dict[str, str] | None = None) -> Response:
    """A JSON response of a msgspec-encodable body."""
    return Response(json_encoder.encode(body), headers=headers, media_type="application/json")
