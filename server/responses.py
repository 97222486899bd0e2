"""Turning worker chunks into OpenAI responses and stream events, for chat and text completions.

Stream events are a function of the accepted chunks alone (one event per chunk that carries text,
logprobs or a finish reason, never merged by arrival timing), numbered from 0 in their SSE `id:`. A
stream rebuilt from Kafka for a resuming client therefore numbers its events exactly as the original
did, and `after` skips those the client already has.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from msgspec import UNSET, UnsetType

from schemas.kafka import Chunk, ChunkUsage, ErrorInfo, TokenLogprob
from schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    Delta,
    ErrorDetail,
    ErrorResponse,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    json_encoder,
)
from server.generation import Generation, error_status
from server.model_files import ModelFiles
from server.sse import DONE, KEEPALIVE, event
from server.streams import ChunkSource, Sequence

_encode = json_encoder.encode


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: ChunkUsage | None = None


def _finish(reason: str | None) -> str | None:
    # "abort" only reaches a client that is gone; report it as "stop" if anyone is still reading.
    return "stop" if reason == "abort" else reason


def total_usage(gen: ChunkSource, states: dict[int, ChoiceState]) -> Usage:
    """Usage of a whole request: each prompt counted once, completions summed."""
    return usage_of(gen.spec.prompt_lens, gen.spec.n, states)


def usage_of(prompt_lens: list[int], n: int, states: dict[int, ChoiceState]) -> Usage:
    """Usage from each prompt's length and every choice's final usage (choice = prompt index * n + c)."""
    prompt = sum(prompt_lens)
    completion = sum(s.usage.completion_tokens for s in states.values() if s.usage)
    cached = 0
    for pi in range(len(prompt_lens)):
        cached += max(
            (states[c].usage.cached_tokens for c in range(pi * n, (pi + 1) * n) if states[c].usage),  # type: ignore[union-attr]
            default=0,
        )
    return Usage(prompt, completion, prompt + completion, PromptTokensDetails(cached))


def _group(batch: list[tuple[Sequence, Chunk]]) -> dict[int, list[Chunk]]:
    out: dict[int, list[Chunk]] = {}
    for seq, chunk in batch:
        out.setdefault(seq.choice, []).append(chunk)
    return out


def _error_event(error: ErrorInfo) -> bytes:
    status = error_status(error)
    detail = ErrorDetail(error.message, status.body().error.type, None, error.code)
    return event(_encode(ErrorResponse(detail)))


def _record(gen: ChunkSource, state: ChoiceState, chunks: list[Chunk]) -> None:
    for c in chunks:
        if c.finish_reason is not None:
            state.finish_reason = c.finish_reason
        if c.usage is not None:
            state.usage = c.usage
            m = gen.metrics
            if m is not None:
                m.completion_tokens.inc(c.usage.completion_tokens)
                m.cached_tokens.inc(c.usage.cached_tokens)


class LogprobFormatter:
    """Token ids to the strings OpenAI shows in logprobs."""

    def __init__(self, model: ModelFiles) -> None:
        self._model = model

    def token(self, token_id: int) -> str:
        """The text of one token as it would appear in the output."""
        return self._model.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        """Chat-style logprobs."""
        content = []
        for e in entries:
            tok = self.token(e.token_id)
            tops = [TopLogprob(self.token(t), lp, list(self.token(t).encode())) for t, lp in e.top]
            content.append(ChatTokenLogprob(tok, e.logprob, list(tok.encode()), tops))
        return ChatLogprobs(content)

    def completion(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        """Legacy completion-style logprobs, text offsets counted from `offset`."""
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for e in entries:
            tok = self.token(e.token_id)
            tokens.append(tok)
            lps.append(e.logprob)
            tops.append({self.token(t): lp for t, lp in e.top} or None)
            offsets.append(offset)
            offset += len(tok)
        return CompletionLogprobs(tokens, lps, tops, offsets)


@dataclass(frozen=True)
class ChoiceDelta:
    """What one choice gained in one batch of chunks."""

    choice: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None


async def _deltas(
    gen: ChunkSource, states: dict[int, ChoiceState]
) -> AsyncIterator[ChoiceDelta | ErrorInfo | None]:
    """One delta per chunk with output, in topic order; None when idle (send a keep-alive); an error ends it."""
    async for batch in gen.chunks():
        if not batch:
            yield None
            continue
        for seq, c in batch:
            _record(gen, states[seq.choice], [c])
            if c.error is not None:
                yield c.error
                return
            if c.text or c.logprobs or c.finish_reason is not None:
                yield ChoiceDelta(seq.choice, c.text, c.logprobs, c.finish_reason)


# ---- chat ----------------------------------------------------------------------------------------


async def chat_stream(gen: ChunkSource, fmt: LogprobFormatter, after: int = -1) -> AsyncIterator[bytes]:
    """`chat.completion.chunk` events, `usage` last when asked for, then `[DONE]`; ids <= `after` are skipped."""
    spec = gen.spec
    usage_field = None if spec.include_usage else UNSET
    states = {c: ChoiceState() for c in range(spec.n)}
    eid = 0

    def chunk(choices: list[ChatChunkChoice], usage: Usage | UnsetType | None = usage_field) -> bytes:
        return event(
            _encode(
                ChatCompletionChunk(
                    id=gen.id, created=gen.created, model=gen.model, choices=choices, usage=usage
                )
            ),
            eid,
        )

    try:
        for c in range(spec.n):
            if eid > after:
                yield chunk([ChatChunkChoice(c, Delta(role="assistant", content=""))])
            eid += 1
        async for d in _deltas(gen, states):
            if d is None:
                yield KEEPALIVE
                continue
            if isinstance(d, ErrorInfo):
                yield _error_event(d)
                yield DONE
                return
            if eid > after:
                logprobs = fmt.chat(d.logprobs) if spec.logprobs else None
                delta = Delta(content=d.text) if d.text or d.finish_reason is None else Delta()
                yield chunk([ChatChunkChoice(d.choice, delta, logprobs, _finish(d.finish_reason))])
            eid += 1
        if spec.include_usage and eid > after:
            yield chunk([], total_usage(gen, states))
        yield DONE
    finally:
        await gen.close()


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


async def collect(gen: ChunkSource) -> dict[int, ChoiceState]:
    """Every choice's whole output; raises APIError if a sequence failed."""
    total = len(gen.spec.prompt_lens) * gen.spec.n
    states = {c: ChoiceState() for c in range(total)}
    async for batch in gen.chunks():
        for choice, chunks in _group(batch).items():
            state = states[choice]
            _record(gen, state, chunks)
            error = absorb(state, chunks)
            if error is not None:
                raise error_status(error)
    return states


async def chat_full(gen: Generation, fmt: LogprobFormatter) -> ChatCompletion:
    """A whole `chat.completion`."""
    states = await collect(gen)
    p = gen.prepared
    return chat_completion(
        gen.id,
        gen.created,
        gen.model,
        states,
        fmt,
        p.sampling.logprobs is not None,
        [len(x) for x in p.prompts],
        p.n,
    )


def chat_completion(
    rid: str,
    created: int,
    model: str,
    states: dict[int, ChoiceState],
    fmt: LogprobFormatter,
    logprobs: bool,
    prompt_lens: list[int],
    n: int,
) -> ChatCompletion:
    """The `chat.completion` body of finished choices (also what a batch item's output line carries)."""
    choices = [
        ChatChoice(
            index=c,
            message=AssistantMessage("assistant", "".join(s.text)),
            logprobs=fmt.chat(s.logprobs) if logprobs else None,
            finish_reason=_finish(s.finish_reason),
        )
        for c, s in sorted(states.items())
    ]
    return ChatCompletion(
        id=rid, created=created, model=model, choices=choices, usage=usage_of(prompt_lens, n, states)
    )


# ---- text completions ----------------------------------------------------------------------------


async def completion_stream(
    gen: ChunkSource, fmt: LogprobFormatter, echo: bool, after: int = -1
) -> AsyncIterator[bytes]:
    """`text_completion` chunk events, `usage` last when asked for, then `[DONE]`; ids <= `after` are skipped."""
    p = gen.spec
    usage_field = None if p.include_usage else UNSET
    total = len(p.prompt_lens) * p.n
    states = {c: ChoiceState() for c in range(total)}
    offsets = {c: 0 for c in range(total)}
    eid = 0

    def chunk(choices: list[CompletionChoice], usage: Usage | UnsetType | None = usage_field) -> bytes:
        return event(
            _encode(
                Completion(id=gen.id, created=gen.created, model=gen.model, choices=choices, usage=usage)
            ),
            eid,
        )

    try:
        if echo:
            for c in range(total):
                text = p.prompt_texts[c // p.n]
                offsets[c] = len(text)
                if eid > after:
                    yield chunk([CompletionChoice(c, text)])
                eid += 1
        async for d in _deltas(gen, states):
            if d is None:
                yield KEEPALIVE
                continue
            if isinstance(d, ErrorInfo):
                yield _error_event(d)
                yield DONE
                return
            if eid > after:
                logprobs = fmt.completion(d.logprobs, offsets[d.choice]) if p.logprobs else None
                yield chunk([CompletionChoice(d.choice, d.text, logprobs, _finish(d.finish_reason))])
            offsets[d.choice] += len(d.text)
            eid += 1
        if p.include_usage and eid > after:
            yield chunk([], total_usage(gen, states))
        yield DONE
    finally:
        await gen.close()


async def completion_full(gen: Generation, fmt: LogprobFormatter, echo: bool) -> Completion:
    """A whole `text_completion`."""
    p = gen.prepared
    states = await collect(gen)
    return text_completion(
        gen.id,
        gen.created,
        gen.model,
        states,
        fmt,
        p.sampling.logprobs is not None,
        [len(x) for x in p.prompts],
        p.n,
        p.prompt_texts if echo else None,
    )


def text_completion(
    rid: str,
    created: int,
    model: str,
    states: dict[int, ChoiceState],
    fmt: LogprobFormatter,
    logprobs: bool,
    prompt_lens: list[int],
    n: int,
    echo_texts: list[str] | None,
) -> Completion:
    """The `text_completion` body of finished choices; `echo_texts` puts each prompt in front."""
    choices = []
    for c, s in sorted(states.items()):
        prefix = echo_texts[c // n] if echo_texts else ""
        lps = fmt.completion(s.logprobs, len(prefix)) if logprobs else None
        choices.append(CompletionChoice(c, prefix + "".join(s.text), lps, _finish(s.finish_reason)))
    return Completion(
        id=rid, created=created, model=model, choices=choices, usage=usage_of(prompt_lens, n, states)
    )
