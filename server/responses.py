"""Worker chunks to OpenAI responses: one stream writer and one whole-response collector for every kind.

A resumable stream's events are a function of the accepted chunks alone (one event per chunk that carries
text, logprobs or a finish reason, never merged by arrival timing), numbered from 0; other streams merge a
choice's chunks that reached the frontend together into one event, as a client that is behind needs. A resumable stream sends
the number as the SSE `id:`; a stream rebuilt from Kafka for a resuming client numbers its events exactly
as the original did, and `after` skips those the client already has. Other streams are `data:`-only, as
OpenAI and vLLM send them: clients such as `vllm bench serve` read every line as `data:`. What each kind's events look like is in
server/shapes.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import msgspec

from schemas.kafka import Chunk, ErrorInfo
from schemas.openai import ErrorDetail, ErrorResponse, Usage, json_encoder
from server.errors import error_status
from server.logprobs import LogprobFormatter
from server.shapes import ChoiceDelta, ChoiceState, Events, usage_of
from server.sse import DONE, KEEPALIVE, event
from server.streams import ChunkSource, Sequence, StreamSpec

_encode = json_encoder.encode

# A kind's event writer for one stream: (source, formatter, echo) -> Events.
EventsFactory = Callable[[ChunkSource, LogprobFormatter, bool], Events]


def _error_event(error: ErrorInfo) -> bytes:
    status = error_status(error)
    detail = ErrorDetail(error.message, status.body().error.type, None, error.code)
    return event(_encode(ErrorResponse(detail)))


def _record(src: ChunkSource, state: ChoiceState, c: Chunk) -> None:
    state.tokens += len(c.token_ids)
    if c.finish_reason is not None:
        state.finish_reason = c.finish_reason
    if c.usage is not None:
        state.usage = c.usage
        m = src.metrics
        if m is not None:
            m.completion_tokens.inc(c.usage.completion_tokens)
            m.cached_tokens.inc(c.usage.cached_tokens)


def _running_usage(body: msgspec.Struct, spec: StreamSpec, tokens: int) -> msgspec.Struct:
    """vLLM's continuous usage stats on a choice's event: its prompt and the `tokens` it has produced so far."""
    choices = getattr(body, "choices", None)
    if not spec.continuous_usage or not choices:
        return body
    prompt = spec.prompt_lens[choices[0].index // spec.n]
    return msgspec.structs.replace(body, usage=Usage(prompt, tokens, prompt + tokens))


def _states(src: ChunkSource) -> dict[int, ChoiceState]:
    spec = src.spec
    return {c: ChoiceState() for c in range(len(spec.prompt_lens) * spec.n)}


def _deltas(
    src: ChunkSource, states: dict[int, ChoiceState], batch: list[tuple[Sequence, Chunk]], merge: bool
) -> tuple[list[ChoiceDelta], ErrorInfo | None]:
    """The deltas of one batch of chunks, in topic order, and the error that ends the stream if one came.

    With `merge`, a choice's consecutive chunks become one delta (the client was behind: OpenAI allows
    multi-token deltas); without it, one delta per chunk with output, so event ids are reproducible."""
    out: list[ChoiceDelta] = []
    for seq, c in batch:
        _record(src, states[seq.choice], c)
        if c.error is not None:
            return out, c.error
        if not (c.text or c.logprobs or c.finish_reason is not None):
            continue
        tokens = states[seq.choice].tokens
        if not merge:
            out.append(
                ChoiceDelta(seq.choice, c.text, c.logprobs, c.finish_reason, tokens, c.prompt_logprobs)
            )
            continue
        last = out[-1] if out else None
        if c.text or c.logprobs:
            if last is not None and last.choice == seq.choice and last.finish_reason is None:
                last.text += c.text
                if c.logprobs:
                    last.logprobs = last.logprobs + c.logprobs
                last.tokens = tokens
                last.prompt_logprobs = last.prompt_logprobs or c.prompt_logprobs
            else:
                out.append(ChoiceDelta(seq.choice, c.text, c.logprobs, None, tokens, c.prompt_logprobs))
        if c.finish_reason is not None:
            # The finish reason in a delta of its own, as OpenAI sends it: the SDK's stream helper closes
            # a tool call only on a finishing chunk that follows the call's deltas.
            out.append(ChoiceDelta(seq.choice, "", [], c.finish_reason, tokens))
    return out, None


async def stream(
    src: ChunkSource, events: Events, after: int = -1, ids: bool = False
) -> AsyncIterator[bytes]:
    """The SSE events of a request: the kind's opening with the first output, one per delta, `usage` last
    when asked for, then `[DONE]`; event ids <= `after` are skipped, and sent as `id:` lines when `ids`. Each
    batch of chunks that arrived together goes out as one write. The source is closed however the stream
    ends."""
    states = _states(src)
    eid = 0
    out: list[bytes] = []

    def emit(body: object) -> None:
        nonlocal eid
        if eid > after:
            out.append(event(_encode(body), eid if ids else None))
        eid += 1

    def flush() -> bytes:
        data = b"".join(out)
        out.clear()
        return data

    opened = False

    def open_once() -> None:
        # The opening goes out with the first output, as vLLM sends its role chunk: sent earlier, it would
        # reach clients before any token and count as their time to first token.
        nonlocal opened
        if not opened:
            opened = True
            for body in events.opening():
                emit(_running_usage(body, src.spec, 0))

    try:
        async for batch in src.chunks():
            if not batch:
                yield KEEPALIVE
                continue
            open_once()
            # Resumable streams number one event per chunk; others merge what arrived together.
            deltas, error = _deltas(src, states, batch, merge=not ids)
            for d in deltas:
                delta = events.delta(d)
                if delta is None:
                    # A delta with nothing to send yet still counts: event ids follow the chunks, so a
                    # resumed stream numbers its events as the original did.
                    eid += 1
                    continue
                emit(_running_usage(delta, src.spec, d.tokens))
            if error is not None:
                out.append(_error_event(error))
                out.append(DONE)
                yield flush()
                return
            if out:
                yield flush()
        open_once()
        spec = src.spec
        if spec.include_usage:
            emit(events.usage(usage_of(spec.prompt_lens, spec.n, states)))
        out.append(DONE)
        yield flush()
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
        if c.prompt_logprobs is not None and state.prompt_logprobs is None:
            state.prompt_logprobs = c.prompt_logprobs
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
