"""The frontend's ASGI app: its routes, and one lifespan that starts and stops everything behind them."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware

from kvstore.connect import redis_client
from schemas.settings import FrontendSettings
from schemas.status import WorkerStatus
from server import endpoints, routes
from server.auth import APIKeyAuth, parse_keys
from server.batch.routes import routes as batch_routes
from server.batch.service import BatchService
from server.disagg import serving
from server.frontend import start_frontend
from server.http import Gate
from server.kinds import CHAT, COMPLETION
from server.metrics import FrontendMetrics
from server.openapi import document_bytes
from server.tenants import configured_tenants
from server.tenants_fair import FairQueue, Slots, reserved_slots, room_of
from server.tenants_quota import QuotaGate
from server.tenants_usage import UsagePublisher, batch_charger

log = logging.getLogger("ferry.frontend")


def create_app(settings: FrontendSettings) -> Starlette:
    """The ASGI app of one frontend; `app.state.frontend` is the started Frontend while it runs."""
    tenants = configured_tenants(settings.tenants, settings.api_keys)  # TenantsError: start-up stops
    api_keys = parse_keys(settings.api_keys)
    if not api_keys and not tenants and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without API keys: anyone who can reach it may use it", settings.host)
    if (api_keys or tenants) and not settings.admin_key:
        log.info("API keys set but no admin key: /v1/admin/* is closed to every caller")
    metrics = FrontendMetrics()
    # The Files and Batches API (server/batch/); a frontend for interactive traffic only joins no batch group.
    batch = BatchService(settings) if settings.batch_api else None

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            if tenants:
                quota_redis = redis_client(settings.redis, connect_timeout_s=1.0)
                stack.push_async_callback(quota_redis.aclose)
                quota = QuotaGate(
                    quota_redis, settings.redis_prefix, tenants, metrics, settings.tenants_fail_open
                )
                app.state.quota = await stack.enter_async_context(quota.running())
                usage = UsagePublisher(settings.kafka, metrics)
                app.state.usage = await stack.enter_async_context(usage.running())
            fe = await stack.enter_async_context(start_frontend(settings, metrics))
            app.state.frontend = fe
            if tenants and settings.tenants_fair:

                def room() -> int:
                    live = fe.pool.live(settings.served_model_name)
                    return room_of(live, fe.svc.router.available(live), settings.busy_waiting)

                def slots() -> Slots | None:
                    live = serving(fe.pool.live(settings.served_model_name))
                    return reserved_slots(live, fe.svc.router.remote, settings.tenants_reserve)

                fair = FairQueue(
                    tenants, room, fe.pool.wait_refreshed, settings.busy_wait_s, settings.max_queued_requests,
                    lambda tenant, n: metrics.tenant_queued.labels(tenant).set(n),
                    settle_s=2 * settings.heartbeat_interval_s, priority_ceiling=settings.batch_priority - 1,
                    slots=slots,
                )  # fmt: skip
                app.state.fair = await stack.enter_async_context(fair.running())

            def batch_workers() -> list[WorkerStatus]:
                return fe.pool.live(settings.served_model_name)

            if batch is not None:
                charge = batch_charger(app.state.usage, app.state.quota, metrics) if tenants else None
                await stack.enter_async_context(batch.running(fe.pre, fe.fmt, batch_workers, charge))
            yield

    app = Starlette(
        routes=[*endpoints.routes(CHAT), *endpoints.routes(COMPLETION), *routes.routes(), *batch_routes()],
        lifespan=lifespan,
        exception_handlers={
            404: routes.not_found,
            405: routes.method_not_allowed,
            Exception: routes.internal_error,
        },
        middleware=[Middleware(APIKeyAuth, api_keys=api_keys, admin_key=settings.admin_key, tenants=tenants)],
    )
    # Exists before the frontend starts: SIGTERM may come at any time (launch/frontend.py).
    app.state.gate = Gate(settings.max_concurrent_requests, metrics)
    app.state.batch = batch
    app.state.openapi = document_bytes(
        settings.served_model_name, bool(api_keys or tenants or settings.admin_key)
    )
    return app
