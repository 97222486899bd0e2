"""The frontend's OpenAPI 3.1 document, generated from the msgspec Structs that decode and encode the API.

Request and response schemas come from `msgspec.json.schema_components`, so the document cannot drift from
what the routes accept: a field added to a Struct appears here by itself. Only the list of routes and the
statuses each can answer are written by hand.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.openai import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    ModelList,
)

_REF = "#/components/schemas/{name}"


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF.format(name=ref)}}}


def _errors(*statuses: int) -> dict[str, Any]:
    reasons = {
        400: "invalid request (the error's `param` names the field)",
        401: "missing, unknown or insufficient API key",
        404: "unknown model",
        413: "body over the size limit",
        503: "no live worker, every worker busy, broker unavailable or overloaded; see `Retry-After`",
    }
    return {str(s): {"description": reasons[s], "content": _json("ErrorResponse")} for s in statuses}


def _generation(summary: str, request: str, response: str, chunk_doc: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "operationId": request[0].lower() + request[1:],
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": f"the whole {response}, or with `stream: true` Server-Sent Events of {chunk_doc}",
                    "content": {
                        **_json(response),
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 401, 404, 413, 503),
            },
        }
    }


def _plain(summary: str, operation_id: str, media: str, statuses: dict[str, str]) -> dict[str, Any]:
    return {
        "get": {
            "summary": summary,
            "operationId": operation_id,
            "security": [],
            "responses": {
                code: {"description": text, "content": {media: {"schema": {}}}}
                for code, text in statuses.items()
            },
        }
    }


def build_document(served_model_name: str, auth: bool) -> dict[str, Any]:
    """The OpenAPI document of a frontend serving `served_model_name`; `auth` adds the bearer scheme."""
    _, components = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, ChatCompletion, Completion, ModelList, ErrorResponse],
        ref_template=_REF,
    )
    # As in OpenAI's own document: any string is accepted (and answered 404 if unknown), the served names
    # are listed so that clients and fuzzers know a valid one.
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        components[request]["properties"]["model"] = {
            "anyOf": [{"type": "string"}, {"type": "string", "enum": [served_model_name]}],
            "description": "the model to use; GET /v1/models lists it",
        }
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "Ferry",
            "version": "1",
            "description": "OpenAI-compatible chat and text completions served by Ferry.",
        },
        "paths": {
            "/v1/chat/completions": _generation(
                "Create a chat completion",
                "ChatCompletionRequest",
                "ChatCompletion",
                "`chat.completion.chunk`s",
            ),
            "/v1/completions": _generation(
                "Create a text completion", "CompletionRequest", "Completion", "`text_completion` chunks"
            ),
            "/v1/models": {
                "get": {
                    "summary": "List the served models",
                    "operationId": "listModels",
                    "responses": {
                        "200": {"description": "the served models", "content": _json("ModelList")},
                        **_errors(401),
                    },
                }
            },
            "/health": _plain(
                "The process can answer requests",
                "health",
                "application/json",
                {"200": "alive", "503": "the reply consumer died: restart the process"},
            ),
            "/ready": _plain(
                "A live worker serves the model",
                "ready",
                "application/json",
                {"200": "ready", "503": "no live worker yet"},
            ),
            "/metrics": _plain("Prometheus metrics", "metrics", "text/plain", {"200": "metrics"}),
        },
        "components": {"schemas": components},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"apiKey": []}]
    return doc


def document_bytes(served_model_name: str, auth: bool) -> bytes:
    """The document as JSON, to be built once per frontend."""
    return msgspec.json.encode(build_document(served_model_name, auth))
