"""Worker chunks to OpenAI responses: one stream writer and one whole-response collector for every kind.

Stream events are a function of the accepted chunks alone (one event per chunk that carries text,
logprobs or a finish reason, never merged by arrival timing), numbered from 0. A resumable stream sends
the number as the SSE `id:`; a stream rebuilt from Kafka for a resuming client numbers its events exactly
as the original did, and `after` skips those the client already has. Other streams are `data:`-only, as
OpenAI and vLLM send them: clients such as `vllm bench serve` read every line as `data:`. What each kind's events look like is in
server/shapes.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from schemas.kafka import Chunk, ErrorInfo
from schemas.openai import ErrorDetail, ErrorResponse, json_encoder
from server.errors import error_status
from server.logprobs import LogprobFormatter
from server.shapes import ChoiceDelta, ChoiceState, Events, usage_of
from server.sse import DONE, KEEPALIVE, event
from server.streams import ChunkSource, Sequence

_encode = json_encoder.encode

# A kind's event writer for one stream: (source, formatter, echo) -> Events.
EventsFactory = Callable[[ChunkSource, LogprobFormatter, bool], Events]


def _error_event(error: ErrorInfo) -> bytes:
    status = error_status(error)
    detail = ErrorDetail(error.message, status.body().error.type, None, error.code)
    return event(_encode(ErrorResponse(detail)))


def _record(src: ChunkSource, state: ChoiceState, c: Chunk) -> None:
    if c.finish_reason is not None:
        state.finish_reason = c.finish_reason
    if c.usage is not None:
        state.usage = c.usage
        m = src.metrics
        if m is not None:
            m.completion_tokens.inc(c.usage.completion_tokens)
            m.cached_tokens.inc(c.usage.cached_tokens)


def _states(src: ChunkSource) -> dict[int, ChoiceState]:
    spec = src.spec
    return {c: ChoiceState() for c in range(len(spec.prompt_lens) * spec.n)}


async def _deltas(
    src: ChunkSource, states: dict[int, ChoiceState]
) -> AsyncIterator[ChoiceDelta | ErrorInfo | None]:
    """One delta per chunk with output, in topic order; None when idle (send a keep-alive); an error ends it."""
    async for batch in src.chunks():
        if not batch:
            yield None
            continue
        for seq, c in batch:
            _record(src, states[seq.choice], c)
            if c.error is not None:
                yield c.error
                return
            if c.text or c.logprobs or c.finish_reason is not None:
                yield ChoiceDelta(seq.choice, c.text, c.logprobs, c.finish_reason)


async def stream(
    src: ChunkSource, events: Events, after: int = -1, ids: bool = False
) -> AsyncIterator[bytes]:
    """The SSE events of a request: the kind's opening, one per delta, `usage` last when asked for, then
    `[DONE]`; event ids <= `after` are skipped, and sent as `id:` lines when `ids`. The source is closed
    however the stream ends."""
    states = _states(src)
    eid = 0

    def framed(body: object, n: int) -> bytes:
        return event(_encode(body), n if ids else None)

    try:
        for body in events.opening():
            if eid > after:
                yield framed(body, eid)
            eid += 1
        async for d in _deltas(src, states):
            if d is None:
                yield KEEPALIVE
                continue
            if isinstance(d, ErrorInfo):
                yield _error_event(d)
                yield DONE
                return
            delta = events.delta(d)
            # A delta with nothing to send yet still counts: event ids follow the chunks, so a resumed
            # stream numbers its events as the original did.
            if delta is not None and eid > after:
                yield framed(delta, eid)
            eid += 1
        spec = src.spec
        if spec.include_usage and eid > after:
            yield framed(events.usage(usage_of(spec.prompt_lens, spec.n, states)), eid)
        yield DONE
    finally:
        await src.close()


def absorb(state: ChoiceState, chunks: list[Chunk]) -> ErrorInfo | None:
    """Add a choice's chunks to what it has produced; returns the error that ended it, if one did."""
    for c in chunks:
        if c.finish_reason is not None:
            state.finish_reason = c.finish_reason
        if c.usage is not None:
            state.usage = c.usage
        if c.error is not None:
            return c.error
        state.text.append(c.text)
        state.logprobs.extend(c.logprobs)
    return None


def _group(batch: list[tuple[Sequence, Chunk]]) -> dict[int, list[Chunk]]:
    out: dict[int, list[Chunk]] = {}
    for seq, chunk in batch:
        out.setdefault(seq.choice, []).append(chunk)
    return out


async def collect(src: ChunkSource) -> dict[int, ChoiceState]:
    """Every choice's whole output; raises APIError if a sequence failed."""
    states = _states(src)
    async for batch in src.chunks():
        for choice, chunks in _group(batch).items():
            state = states[choice]
            for c in chunks:
                _record(src, state, c)
            error = absorb(state, chunks)
            if error is not None:
                raise error_status(error)
    return states
