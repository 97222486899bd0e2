"""What chat and text completions look like: each kind's stream chunks and whole response body.

A stream's chunks are a function of the accepted chunks alone (see server/responses.py), so a kind's
event writer holds only what earlier deltas determine (a completion's text offsets for logprobs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
from msgspec import UNSET, UnsetType

from schemas.kafka import ChunkUsage, TokenLogprob
from schemas.openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChoice,
    Delta,
    DeltaToolCall,
    PromptTokensDetails,
    Usage,
)
from schemas.streams import ToolCallMode
from server.logprobs import LogprobFormatter
from server.streams import ChunkSource
from server.tool_parsers import ToolParser, parser_for
from server.tool_parsers.base import Step


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: ChunkUsage | None = None
    tokens: int = 0  # produced so far (continuous usage stats)
    # From the first chunk that has them (a moved sequence's later attempts cover a longer prompt).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained from one chunk, or from consecutive chunks that arrived together."""

    choice: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None
    tokens: int = 0  # the choice's tokens up to and including this delta (continuous usage stats)
    # The prompt logprobs of the first of its chunks that had them (an echoed prompt's logprobs).
    prompt_logprobs: list[TokenLogprob | None] | None = None


def finish(reason: str | None, called: bool = False, mode: ToolCallMode | None = None) -> str | None:
    """A finish reason as clients see it: "abort" only reaches a client that is gone, so it reads "stop".

    A choice that ended by stopping after calling tools reads "tool_calls", except for a named
    `tool_choice`, which reads "stop" (OpenAI's and vLLM's rule).
    """
    reason = "stop" if reason == "abort" else reason
    if reason == "stop" and called and mode is not None and mode.choice != "named":
        return "tool_calls"
    return reason


def _merged(calls: list[DeltaToolCall], mode: ToolCallMode) -> list[DeltaToolCall]:
    # One entry per call and chunk (a call's first piece and more of its arguments can come together);
    # without parallel calls, only the first call is kept (as vLLM filters).
    out: list[DeltaToolCall] = []
    for c in calls:
        if not mode.parallel and c.index > 0:
            continue
        last = out[-1] if out else None
        if last is not None and last.index == c.index and last.function and c.function:
            last.function.arguments = (last.function.arguments or "") + (c.function.arguments or "")
        else:
            out.append(c)
    return out


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


@dataclass(frozen=True)
class Finished:
    """A request's finished choices and what shapes its whole body."""

    id: str
    created: int
    model: str
    states: dict[int, ChoiceState]
    logprobs: bool
    prompt_lens: list[int]
    n: int
    # The prompts put in front of each choice's text (completions with `echo`), else None.
    echo_texts: list[str] | None = None
    # Chat requests with tools: how the output becomes tool calls.
    tools: ToolCallMode | None = None
    # Each prompt's first token: an echoed prompt's logprobs start with it.
    first_tokens: list[int] | None = None
    # False when the prompt logprobs were computed only for an echo's logprobs (not asked for as such).
    show_prompt_logprobs: bool = True


class Events(Protocol):
    """One stream's chunk bodies, in the kind's shape."""

    def opening(self) -> Iterator[msgspec.Struct]:
        """Bodies sent with the first output, before its deltas (chat: the role of each choice; completions:
        none, an echoed prompt goes with its choice's first delta)."""
        ...

    def delta(self, d: ChoiceDelta) -> msgspec.Struct | None:
        """The body carrying one choice's delta; None when it carries nothing to send yet (a chat choice's
        text held back because it may be the start of a tool call)."""
        ...

    def usage(self, usage: Usage) -> msgspec.Struct:
        """The last body, carrying the request's usage."""
        ...


class ChatEvents:
    """`chat.completion.chunk` bodies."""

    def __init__(self, src: ChunkSource, fmt: LogprobFormatter, echo: bool = False) -> None:
        self._src = src
        self._fmt = fmt
        self._usage: Usage | UnsetType | None = None if src.spec.include_usage else UNSET
        # With tools: each choice's parser, and the choices that called any.
        self._tools = src.spec.tools
        self._parsers: dict[int, ToolParser] = {}
        self._called: set[int] = set()

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | UnsetType | None = None) -> ChatCompletionChunk:
        src = self._src
        return ChatCompletionChunk(
            id=src.id, created=src.created, model=src.model, choices=choices,
            usage=self._usage if usage is None else usage,
        )  # fmt: skip

    def opening(self) -> Iterator[msgspec.Struct]:
        """A role delta per choice."""
        for c in range(self._src.spec.n):
            yield self._chunk([ChatChunkChoice(c, Delta(role="assistant", content=""))])

    def delta(self, d: ChoiceDelta) -> msgspec.Struct | None:
        """Text (or nothing, on the finishing chunk) with its logprobs; with tools, the content and tool-call
        pieces the choice's parser makes of it."""
        logprobs = self._fmt.chat(d.logprobs) if self._src.spec.logprobs else None
        if self._tools is None:
            delta = Delta(content=d.text) if d.text or d.finish_reason is None else Delta()
            return self._chunk([ChatChunkChoice(d.choice, delta, logprobs, finish(d.finish_reason))])
        parser = self._parsers.get(d.choice)
        if parser is None:
            parser = self._parsers[d.choice] = parser_for(self._tools, self._src.id, d.choice)
        step = parser.feed(d.text) if d.text else Step()
        if d.finish_reason is not None:
            step.extend(parser.end())
        calls = _merged(step.calls, self._tools)
        if calls:
            self._called.add(d.choice)
        if not step.content and not calls and d.finish_reason is None and logprobs is None:
            return None
        delta = Delta(content=step.content or None, tool_calls=calls or None)
        reason = finish(d.finish_reason, d.choice in self._called, self._tools)
        return self._chunk([ChatChunkChoice(d.choice, delta, logprobs, reason)])

    def usage(self, usage: Usage) -> msgspec.Struct:
        """No choices, the usage."""
        return self._chunk([], usage)


class CompletionEvents:
    """`text_completion` chunk bodies. As vLLM sends them, an echoed prompt goes in front of its choice's
    first delta, its tokens' logprobs in front of the output's; text offsets count from the start of the
    choice's text, each token advancing them by its length."""

    def __init__(self, src: ChunkSource, fmt: LogprobFormatter, echo: bool = False) -> None:
        self._src = src
        self._fmt = fmt
        self._echo = echo
        spec = src.spec
        self._usage: Usage | UnsetType | None = None if spec.include_usage else UNSET
        # The next text offset of each choice that has sent a delta.
        self._offsets: dict[int, int] = {}

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | UnsetType | None = None) -> Completion:
        src = self._src
        return Completion(
            id=src.id, created=src.created, model=src.model, choices=choices,
            usage=self._usage if usage is None else usage,
        )  # fmt: skip

    def opening(self) -> Iterator[msgspec.Struct]:
        """Nothing: an echoed prompt goes with its choice's first delta."""
        return iter(())

    def delta(self, d: ChoiceDelta) -> msgspec.Struct:
        """Text with its logprobs; a choice's first also carries its echoed prompt."""
        spec = self._src.spec
        text = d.text
        entries: list[TokenLogprob | int] = list(d.logprobs)
        offset = self._offsets.get(d.choice)
        if offset is None:
            offset = 0
            if self._echo:
                p = d.choice // spec.n
                text = spec.prompt_texts[p] + text
                if spec.logprobs:
                    entries = self._fmt.echoed(spec.first_tokens, p, d.prompt_logprobs, spec.prompt_lens[p]) + entries
        logprobs = None
        if spec.logprobs:
            logprobs = self._fmt.completion(entries, offset)
            if logprobs.tokens:
                # By the tokens shown, not the text (held back for stop strings, it lags them), as vLLM does.
                offset = logprobs.text_offset[-1] + len(logprobs.tokens[-1])
        self._offsets[d.choice] = offset
        return self._chunk([CompletionChoice(d.choice, text, logprobs, finish(d.finish_reason))])

    def usage(self, usage: Usage) -> msgspec.Struct:
        """No choices, the usage."""
        return self._chunk([], usage)


def _message(done: Finished, choice: int, text: str) -> AssistantMessage:
    mode = done.tools
    if mode is None:
        return AssistantMessage("assistant", text)
    content, calls = parser_for(mode, done.id, choice).whole(text)
    if not mode.parallel:
        calls = calls[:1]
    if not calls:
        return AssistantMessage("assistant", content)
    return AssistantMessage("assistant", content, tool_calls=calls)


def chat_completion(done: Finished, fmt: LogprobFormatter) -> ChatCompletion:
    """The `chat.completion` body of finished choices (also what a batch item's output line carries)."""
    choices = []
    for c, s in sorted(done.states.items()):
        message = _message(done, c, "".join(s.text))
        called = isinstance(message.tool_calls, list)
        choices.append(
            ChatChoice(
                index=c,
                message=message,
                logprobs=fmt.chat(s.logprobs) if done.logprobs else None,
                finish_reason=finish(s.finish_reason, called, done.tools),
            )
        )
    usage = usage_of(done.prompt_lens, done.n, done.states)
    body = ChatCompletion(id=done.id, created=done.created, model=done.model, choices=choices, usage=usage)
    # One prompt per chat request: vLLM shows its logprobs once, on the response.
    first = done.states.get(0)
    if first is not None and first.prompt_logprobs is not None:
        body.prompt_logprobs = fmt.prompt(first.prompt_logprobs)
    return body


def text_completion(done: Finished, fmt: LogprobFormatter) -> Completion:
    """The `text_completion` body of finished choices; `echo_texts` puts each prompt (and, with logprobs, its
    tokens' logprobs) in front."""
    choices = []
    for c, s in sorted(done.states.items()):
        p = c // done.n
        prefix = done.echo_texts[p] if done.echo_texts else ""
        lps = None
        if done.logprobs:
            entries: list[TokenLogprob | int] = list(s.logprobs)
            if done.echo_texts:
                entries = fmt.echoed(done.first_tokens, p, s.prompt_logprobs, done.prompt_lens[p]) + entries
            lps = fmt.completion(entries, 0)
        choice = CompletionChoice(c, prefix + "".join(s.text), lps, finish(s.finish_reason))
        if s.prompt_logprobs is not None and done.show_prompt_logprobs:
            choice.prompt_logprobs = fmt.prompt(s.prompt_logprobs)
        choices.append(choice)
    usage = usage_of(done.prompt_lens, done.n, done.states)
    return Completion(id=done.id, created=done.created, model=done.model, choices=choices, usage=usage)
