"""vLLM's engine admin routes on the frontend: sleep, wake_up, reset_prefix_cache, is_sleeping.

As vLLM's server takes them (`POST /sleep?level=1`, `POST /wake_up`, `POST /reset_prefix_cache`, `GET
/is_sleeping`), under /v1/admin/ and with `worker_id` naming one worker (default: every live worker of the
model). Each is an EngineControl message to the workers' topics (workers/engine_control.py), answered
like the LoRA operations, whose exchange it shares (server/lora_admin.py).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from schemas.kafka import EngineControl
from server.errors import APIError
from server.frontend import Frontend
from server.http import route


def _level(request: Request) -> int:
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise APIError(400, "'level' must be 1 or 2.", param="level", code="invalid_value")
    return int(raw)


async def _run(fe: Frontend, request: Request, op: str, level: int = 1) -> Response:
    admin = fe.lora_admin
    wid = request.query_params.get("worker_id")
    # A sleeping worker heartbeats as draining: out of routing, but registered, and wake_up must reach it.
    model = fe.settings.served_model_name
    known = sorted(w.worker_id for w in fe.pool.workers.values() if w.model == model)
    if wid is not None and wid not in known:
        raise APIError(
            404, f"No worker `{wid}` serves `{model}`.", param="worker_id", code="worker_not_found"
        )
    if not known:
        raise APIError(
            503, f"No worker serves the model `{model}` right now.", code="no_workers", retry_after=1
        )
    targets = [wid] if wid is not None else known
    acks = await admin._exchange(targets, lambda op_id, topic: EngineControl(op_id, op, topic, level))  # type: ignore[arg-type,return-value]
    done = admin._outcome(acks, op.replace("_", " "), fe.settings.served_model_name)
    await fe.pool.tick()
    return JSONResponse({"op": op, "workers": done})


async def sleep(fe: Frontend, request: Request) -> Response:
    """POST /v1/admin/sleep?level=1[&worker_id=]: leave routing, clear the index entries, sleep the engine."""
    return await _run(fe, request, "sleep", _level(request))


async def wake_up(fe: Frontend, request: Request) -> Response:
    """POST /v1/admin/wake_up[?worker_id=]: wake the engine and rejoin routing."""
    return await _run(fe, request, "wake_up")


async def reset_prefix_cache(fe: Frontend, request: Request) -> Response:
    """POST /v1/admin/reset_prefix_cache[?worker_id=]: drop cached blocks and their index entries."""
    return await _run(fe, request, "reset_prefix_cache")


async def is_sleeping(fe: Frontend, request: Request) -> Response:
    """GET /v1/admin/is_sleeping: each registered worker of the model, true if out of routing (asleep or draining)."""
    model = fe.settings.served_model_name
    workers = sorted((w for w in fe.pool.workers.values() if w.model == model), key=lambda w: w.worker_id)
    return JSONResponse({"workers": {w.worker_id: w.draining for w in workers}})


def routes() -> list[Route]:
    """Every route of this module."""
    return [
        Route("/v1/admin/sleep", route("admin")(sleep), methods=["POST"]),
        Route("/v1/admin/wake_up", route("admin")(wake_up), methods=["POST"]),
        Route("/v1/admin/reset_prefix_cache", route("admin")(reset_prefix_cache), methods=["POST"]),
        Route("/v1/admin/is_sleeping", route("admin")(is_sleeping), methods=["GET"]),
    ]
