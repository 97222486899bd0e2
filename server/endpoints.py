"""The generation endpoints' handlers: one for a new request of either kind, one for resuming its stream."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from schemas.streams import StreamRecord
from server.errors import APIError, broker_unavailable
from server.frontend import Frontend
from server.generation import Generation, new_id
from server.http import admit_tenant, decode, json_response, read_body, route, until_disconnect, with_turn
from server.kinds import KINDS, Kind
from server.responses import collect, stream
from server.resume import Replay, parse_last_event_id
from server.shapes import Finished
from server.sse import SSEResponse

log = logging.getLogger("ferry.frontend")


def _headers(gen: Generation) -> dict[str, str]:
    seqs = gen.stream.sequences.values()
    headers = {
        "x-request-id": gen.id,
        "x-ferry-worker": ",".join(gen.worker_ids),
        "x-ferry-predicted-cached-blocks": str(gen.predicted_cached_blocks),
        "x-ferry-predicted-host-blocks": str(sum(s.decision.predicted_host_blocks for s in seqs)),
    }
    if any(s.placement != "off" for s in seqs):
        # Disaggregated serving: per sequence, remote (x-ferry-worker prefills) or local prefill, and its
        # decode worker.
        headers["x-ferry-disagg"] = ",".join(s.placement for s in seqs)
        headers["x-ferry-decode-worker"] = ",".join(s.decode_worker for s in seqs)
    return headers


def _wants_resumable(request: Request) -> bool:
    return request.headers.get("x-ferry-resumable", "").strip().lower() in ("1", "true", "yes")


async def _remember(fe: Frontend, gen: Generation, kind: Kind, echo: bool) -> dict[str, str]:
    """Save a resumable stream's record; headers telling the client whether it can resume."""
    if not gen.resumable:
        return {}
    spec = gen.spec
    record = StreamRecord(
        topic=gen.reply_topic, offset=gen.first_offset, kind=kind.name, model=gen.model, created=gen.created,
        n=spec.n, prompt_lens=spec.prompt_lens, include_usage=spec.include_usage, logprobs=spec.logprobs,
        echo_texts=spec.prompt_texts if echo else [], first_tokens=spec.first_tokens, frontend_id=fe.settings.frontend_id, tools=spec.tools,
        continuous_usage=spec.continuous_usage,
        held_first=[s.choice for s in gen.stream.sequences.values() if s.hold_first],
    )  # fmt: skip
    try:
        async with asyncio.timeout(fe.settings.kafka_timeout_s):
            await fe.svc.resume.save(gen.id, record)
    except Exception as exc:
        # Still served, just not resumable: it is cancelled when the client leaves, as usual.
        log.warning("could not save the resume record of %s (%r); it will not be resumable", gen.id, exc)
        gen.resumable = False
        return {"x-ferry-resumable": "0"}
    return {"x-ferry-resumable": "1"}


async def _generate(kind: Kind, fe: Frontend, request: Request) -> Response:
    """POST of a new request: decode, prepare, route and submit; then stream it or answer it whole."""
    req = decode(kind.decoder, await read_body(request, fe.settings.max_body_bytes))
    request.state.model = req.model
    max_len = fe.max_model_len(req.model)
    with fe.metrics.tokenize_seconds.time():
        prepared = await kind.prepare(fe.pre, req, max_len)
    if fe.settings.log_prompts:
        # Only when asked: prompts are private. A token-id prompt is logged as its ids (its text is decoded
        # only for an echo).
        shown = [t or p for t, p in zip(prepared.prompt_texts, prepared.prompts, strict=True)]
        log.info("%s prompt(s): %r", kind.name, shown)
    prompt_tokens = sum(len(p) for p in prepared.prompts)
    fe.metrics.prompt_tokens.inc(prompt_tokens)
    limits = await admit_tenant(request, prompt_tokens)  # 429 over the tenant's quota
    prepared = with_turn(request, prepared)
    resumable = _wants_resumable(request) and prepared.stream
    gen = Generation(fe.svc, req.model, prepared, new_id(kind.id_prefix), resumable, request.state.arrived)
    request.state.completion_tokens = lambda: sum(len(s.token_ids) for s in gen.stream.sequences.values())
    request.state.cached_tokens = lambda: sum(gen.cached_by_prompt.values())
    await gen.start()
    echo = kind.echo(req)
    if prepared.stream:
        headers = {**_headers(gen), **await _remember(fe, gen, kind, echo), **limits}
        return SSEResponse(stream(gen, kind.events(gen, fe.fmt, echo), ids=gen.resumable), headers)  # type: ignore[return-value]
    try:
        states = await until_disconnect(request, collect(gen))
    finally:
        request.state.error_counted = gen.failed  # counted by the generation as it arrived
        await gen.close()
    spec = gen.spec
    done = Finished(gen.id, gen.created, gen.model, states, spec.logprobs, spec.prompt_lens, spec.n,
                    spec.prompt_texts if echo else None, spec.tools, spec.first_tokens,
                    prepared.show_prompt_logprobs)  # fmt: skip
    return json_response(kind.whole(done, fe.fmt), {**_headers(gen), **limits})


async def _resume(kind: Kind, fe: Frontend, request: Request) -> Response:
    """GET of the rest of a resumable stream: the events after `Last-Event-ID` (all of them without it),
    then the request live."""
    rid = request.path_params["id"]
    after = parse_last_event_id(request.headers.get("last-event-id"))
    if after < -1:
        raise APIError(400, "Last-Event-ID must be the integer id of an event of this stream.",
                       param="Last-Event-ID", code="invalid_last_event_id")  # fmt: skip
    try:
        async with asyncio.timeout(fe.settings.kafka_timeout_s):
            record = await fe.svc.resume.load(rid)
    except Exception as exc:
        raise APIError(503, "Resumable streams are unavailable right now (Redis).", code="redis_unavailable",
                       retry_after=2) from exc  # fmt: skip
    if record is None or KINDS.get(record.kind) is not kind:
        raise APIError(404, f"No resumable stream `{rid}` (unknown, not resumable, or expired).",
                       code="stream_not_found")  # fmt: skip
    s = fe.settings
    replay = Replay(rid, record, s.kafka, fe.svc.resume, s.sse_keepalive_s, s.request_timeout_s,
                    s.resume_grace_s, s.kafka_fetch_wait_ms)  # fmt: skip
    try:
        async with asyncio.timeout(s.kafka_timeout_s):
            await replay.start()
    except Exception as exc:
        await replay.close()
        raise broker_unavailable() from exc
    events = stream(replay, kind.events(replay, fe.fmt, bool(record.echo_texts)), after, ids=True)
    return SSEResponse(events, {"x-request-id": rid, "x-ferry-resumable": "1"})  # type: ignore[return-value]


def routes(kind: Kind) -> list[Route]:
    """The routes of one generation endpoint: POST a request, GET the rest of a resumable stream."""

    async def generate(fe: Frontend, request: Request) -> Response:
        return await _generate(kind, fe, request)

    async def resume(fe: Frontend, request: Request) -> Response:
        return await _resume(kind, fe, request)

    return [
        Route(kind.path, route(kind.metric, admit=True)(generate), methods=["POST"]),
        Route(f"{kind.path}/{{id}}/stream", route("resume")(resume), methods=["GET"]),
    ]
