"""The frontend's routes besides generation: models, health, readiness, metrics, OpenAPI, LoRA admin, errors."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from schemas.admin import LoraAdapterList, load_lora_decoder, unload_lora_decoder
from schemas.openai import ModelCard, ModelList
from server import engine_admin, vllm_routes
from server.discovery import prometheus_targets
from server.errors import APIError
from server.frontend import Frontend
from server.http import decode, json_response, read_body, route


async def list_models(fe: Frontend, request: Request) -> Response:
    """GET /v1/models: the model this frontend serves, with its context length once a worker is up."""
    lens = fe.pool.models()
    name = fe.settings.served_model_name
    card = ModelCard(id=name, created=fe.started, root=str(fe.model.path), max_model_len=lens.get(name))
    paths = fe.lora_admin.paths
    # LoRA adapters as vLLM lists them: their own entry, `parent` = the base model.
    cards = [card] + [
        ModelCard(id=a, created=fe.started, root=paths.get(a), parent=base, max_model_len=n)
        for a, (base, n) in sorted(fe.pool.adapters().items())
        if base == name
    ]
    return json_response(ModelList(data=cards))


async def health(request: Request) -> Response:
    """GET /health: the process is alive and can still answer requests (503 once its reply consumer died)."""
    fe: Frontend = request.app.state.frontend
    failed = fe.svc.demux.failed
    if failed is not None:
        # Nothing this process sends out can come back: a supervisor should restart it.
        return JSONResponse({"status": "failed", "reason": f"reply consumer failed: {failed!r}"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """GET /ready: 200 once a live worker serves the model (`?model=` or this frontend's)."""
    fe: Frontend = request.app.state.frontend
    model = request.query_params.get("model", fe.settings.served_model_name)
    workers = fe.pool.live(model)
    draining = request.app.state.gate.draining
    body = {"ready": bool(workers), "model": model, "workers": [w.worker_id for w in workers]}
    if fe.indexer is not None:
        body["kv_index"] = fe.indexer.detail()  # rebuilding: routing weighs load alone for some workers
    if draining:
        body = {**body, "ready": False, "draining": True}
    return JSONResponse(body, status_code=200 if workers and not draining else 503)


async def metrics(request: Request) -> Response:
    """GET /metrics in the Prometheus text format."""
    fe: Frontend = request.app.state.frontend
    return Response(generate_latest(fe.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def openapi_json(request: Request) -> Response:
    """GET /openapi.json: the API's OpenAPI 3.1 document, generated from the request and response Structs."""
    return Response(request.app.state.openapi, media_type="application/json")


async def load_lora_adapter(fe: Frontend, request: Request) -> Response:
    """POST /v1/admin/load_lora_adapter (vLLM's body)."""
    body = decode(load_lora_decoder, await read_body(request, fe.settings.max_body_bytes))
    return json_response(await fe.lora_admin.load(body))


async def unload_lora_adapter(fe: Frontend, request: Request) -> Response:
    """POST /v1/admin/unload_lora_adapter (vLLM's body)."""
    body = decode(unload_lora_decoder, await read_body(request, fe.settings.max_body_bytes))
    return json_response(await fe.lora_admin.unload(body))


async def list_lora_adapters(fe: Frontend, request: Request) -> Response:
    """GET /v1/admin/lora_adapters: which live worker holds which adapter."""
    return json_response(LoraAdapterList(data=fe.lora_admin.listing()))


def routes() -> list[Route]:
    """Every route of this module."""
    return [
        Route("/v1/models", route("models")(list_models), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/discovery/prometheus", route("discovery")(prometheus_targets), methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/v1/admin/load_lora_adapter", route("admin")(load_lora_adapter), methods=["POST"]),
        Route("/v1/admin/unload_lora_adapter", route("admin")(unload_lora_adapter), methods=["POST"]),
        Route("/v1/admin/lora_adapters", route("admin")(list_lora_adapters), methods=["GET"]),
        *vllm_routes.routes(),
        *engine_admin.routes(),
    ]


async def not_found(request: Request, exc: Exception) -> Response:
    """Unknown paths get an OpenAI-style 404 too."""
    return APIError(404, f"Unknown path {request.url.path}", code="not_found").response()


async def method_not_allowed(request: Request, exc: Exception) -> Response:
    """Wrong method on a known path."""
    return APIError(405, f"Method {request.method} not allowed on {request.url.path}", code="method_not_allowed").response()


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug still answers in OpenAI's shape (Starlette logs the traceback after this response)."""
    return APIError(500, "The server had an error while processing your request.", code="internal_error").response()
