"""HTTP routes of the OpenAI Files and Batches API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from schemas.batch import (
    Batch,
    BatchList,
    FileDeleted,
    FileList,
    FileObject,
    batch_create_decoder,
)
from schemas.openai import json_encoder
from server.batch.coordinator import BatchCoordinator, new_batch_id, new_file_id
from server.batch.service import BatchService
from server.batch.validate import parse_batch_file
from server.errors import APIError, from_validation_error

log = logging.getLogger("ferry.batch")

Handler = Callable[[BatchService, BatchCoordinator, Request], Awaitable[Response]]


def _json(obj: object, status: int = 200) -> Response:
    return Response(json_encoder.encode(obj), status, media_type="application/json")


def _route(fn: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def route(request: Request) -> Response:
        svc: BatchService | None = request.app.state.batch
        try:
            if svc is None:
                raise APIError(
                    404, "This frontend does not serve the Batch API (it runs with --no-batch-api).",
                    code="not_found",
                )
            if svc.coordinator is None:
                raise APIError(503, "The batch API is starting.", code="unavailable", retry_after=1)
            return await fn(svc, svc.coordinator, request)
        except APIError as err:
            return err.response()

    return route


def _limit(request: Request, default: int = 20) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise APIError(400, "`limit` must be an integer from 1 to 100.", param="limit", code="invalid_value")
    return int(raw)


# ---- files ---------------------------------------------------------------------------------------


async def create_file(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """POST /v1/files: a multipart upload with `purpose=batch`; the JSONL is checked line by line."""
    limit = svc.settings.batch_max_file_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit + 65536:
        raise APIError(413, f"Files may be at most {limit} bytes.", code="file_too_large")
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise APIError(
            400,
            "Upload the file as multipart/form-data with fields `file` and `purpose`.",
            code="invalid_request",
        )
    async with request.form(max_files=1, max_fields=8) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose != "batch":
            raise APIError(
                400, f"`purpose` must be `batch`, not {purpose!r}.", param="purpose", code="invalid_value"
            )
        if not isinstance(upload, UploadFile):
            raise APIError(400, "Missing the `file` part.", param="file", code="missing_required_parameter")
        if upload.size is not None and upload.size > limit:
            raise APIError(413, f"Files may be at most {limit} bytes.", code="file_too_large")
        data = await upload.read()
        filename = upload.filename or "upload.jsonl"
    parsed = await asyncio.to_thread(parse_batch_file, data, svc.settings.batch_max_requests)
    if parsed.errors:
        first = parsed.errors[0]
        more = (
            f" ({len(parsed.errors) - 1} more problem(s): "
            + "; ".join(e.message for e in parsed.errors[1:])
            + ")"
        )
        raise APIError(
            400,
            first.message + (more if len(parsed.errors) > 1 else ""),
            param=first.param or "file",
            code=first.code,
        )
    meta = FileObject(
        id=new_file_id(), bytes=len(data), created_at=int(time.time()), filename=filename, purpose="batch"
    )
    await co.files.write(meta.id, [data])
    await svc.store.put_file(meta)
    return _json(meta)


async def _file(svc: BatchService, request: Request) -> FileObject:
    file_id = request.path_params["file_id"]
    meta = await svc.store.get_file(file_id)
    if meta is None:
        raise APIError(404, f"No file with id {file_id}.", param="file_id", code="not_found")
    return meta


async def get_file(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """GET /v1/files/{file_id}."""
    return _json(await _file(svc, request))


async def list_files(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """GET /v1/files, newest first (`after`, `limit`, `purpose`)."""
    files, more = await svc.store.list_files(
        request.query_params.get("after"), _limit(request, 100), request.query_params.get("purpose")
    )
    return _json(
        FileList(
            data=files,
            has_more=more,
            first_id=files[0].id if files else None,
            last_id=files[-1].id if files else None,
        )
    )


async def file_content(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """GET /v1/files/{file_id}/content: the bytes as stored."""
    meta = await _file(svc, request)
    try:
        data = await co.files.read(meta.id)
    except FileNotFoundError:
        raise APIError(404, f"The content of file {meta.id} is gone.", code="not_found") from None
    return Response(data, media_type="application/jsonl")


async def delete_file(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """DELETE /v1/files/{file_id}."""
    meta = await _file(svc, request)
    await svc.store.delete_file(meta.id)
    await co.files.delete(meta.id)
    return _json(FileDeleted(id=meta.id))


# ---- batches -------------------------------------------------------------------------------------


async def create_batch(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """POST /v1/batches: starts `validating`; the coordinators take it from there."""
    body = await request.body()
    try:
        req = batch_create_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise from_validation_error(exc) from None
    window = co.windows.get(req.completion_window)
    if window is None:
        raise APIError(
            400,
            f"`completion_window` must be one of {', '.join(co.windows)}, not {req.completion_window!r}.",
            param="completion_window",
            code="invalid_value",
        )
    meta = await svc.store.get_file(req.input_file_id)
    if meta is None:
        raise APIError(404, f"No file with id {req.input_file_id}.", param="input_file_id", code="not_found")
    if meta.purpose != "batch":
        raise APIError(
            400,
            f"File {meta.id} has purpose {meta.purpose!r}, not `batch`.",
            param="input_file_id",
            code="invalid_value",
        )
    now = int(time.time())
    batch = Batch(
        id=new_batch_id(),
        endpoint=req.endpoint,
        input_file_id=req.input_file_id,
        completion_window=req.completion_window,
        status="validating",
        created_at=now,
        expires_at=now + window,
        model=svc.settings.served_model_name,
        metadata=req.metadata,
    )
    tenant = getattr(request.state, "tenant", None)
    if tenant is not None:
        # Before the batch is visible: whichever frontend submits it charges its items to this tenant.
        await svc.store.set_fields(batch.id, {"tenant": tenant, "key_id": request.state.key_id})
    await svc.store.create_batch(batch)
    co.kick()
    stored = await svc.store.get_batch(batch.id)
    return _json(stored or batch)


async def get_batch(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """GET /v1/batches/{batch_id}."""
    batch_id = request.path_params["batch_id"]
    batch = await svc.store.get_batch(batch_id)
    if batch is None:
        raise APIError(404, f"No batch with id {batch_id}.", param="batch_id", code="not_found")
    return _json(batch)


async def list_batches(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """GET /v1/batches, newest first (`after`, `limit`)."""
    batches, more = await svc.store.list_batches(request.query_params.get("after"), _limit(request))
    return _json(
        BatchList(
            data=batches,
            has_more=more,
            first_id=batches[0].id if batches else None,
            last_id=batches[-1].id if batches else None,
        )
    )


async def cancel_batch(svc: BatchService, co: BatchCoordinator, request: Request) -> Response:
    """POST /v1/batches/{batch_id}/cancel."""
    return _json(await co.cancel(request.path_params["batch_id"]))


def routes() -> list[Route]:
    """The Files and Batches routes, to mount in the frontend's app."""
    return [
        Route("/v1/files", _route(create_file), methods=["POST"]),
        Route("/v1/files", _route(list_files), methods=["GET"]),
        Route("/v1/files/{file_id}", _route(get_file), methods=["GET"]),
        Route("/v1/files/{file_id}", _route(delete_file), methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", _route(file_content), methods=["GET"]),
        Route("/v1/batches", _route(create_batch), methods=["POST"]),
        Route("/v1/batches", _route(list_batches), methods=["GET"]),
        Route("/v1/batches/{batch_id}", _route(get_batch), methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", _route(cancel_batch), methods=["POST"]),
    ]
