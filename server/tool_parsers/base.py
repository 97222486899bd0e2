"""What every tool-call parser shares: turning calls found in the output so far into stream deltas."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.openai import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall

# The id of the call at an index (a function of the request, the choice and the index: a resumed stream
# must name its calls as the original did).
CallIds = Callable[[int], str]


@dataclass
class Step:
    """What one piece of output adds: text for `content`, and pieces of tool calls."""

    content: str = ""
    calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)

    def extend(self, other: Step) -> None:
        """Append another step's content and call pieces."""
        self.content += other.content
        self.calls.extend(other.calls)


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with (text held back: it may be the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@dataclass
class _Sent:
    name: str
    arguments: str = ""


class CallTracker:
    """The calls streamed so far: emits a call's first piece (id, type, name) once its name is complete,
    then whatever its raw argument text has gained since."""

    def __init__(self, ids: CallIds) -> None:
        self._ids = ids
        self.sent: list[_Sent] = []

    def update(self, index: int, name: str | None, arguments: str | None) -> list[DeltaToolCall]:
        """Pieces for call `index` given its name (None until complete) and its argument text so far."""
        out: list[DeltaToolCall] = []
        if index == len(self.sent):
            if name is None:
                return out
            self.sent.append(_Sent(name))
            out.append(DeltaToolCall(index, self._ids(index), "function", DeltaFunctionCall(name, "")))
        elif index > len(self.sent):
            return out  # an earlier call has no name yet: calls start in order
        sent = self.sent[index]
        if (
            arguments is not None
            and len(arguments) > len(sent.arguments)
            and arguments.startswith(sent.arguments)
        ):
            piece = arguments[len(sent.arguments) :]
            sent.arguments = arguments
            if out:
                out[0].function = DeltaFunctionCall(sent.name, piece)
            else:
                out.append(DeltaToolCall(index, function=DeltaFunctionCall(arguments=piece)))
        return out


class ToolParser(ABC):
    """Reads tool calls out of a model's output, streamed (`feed` then `end`) or whole (`whole`).

    The streamed calls are exact pieces of the output (raw argument text); `whole` gives what vLLM's
    parser of the same name gives for the complete output, arguments re-encoded as vLLM does.
    """

    # Whether the format's markers may be special tokens, which must then stay in the output text.
    keeps_special_tokens = False

    def __init__(self, ids: CallIds) -> None:
        self.ids = ids
        self.tracker = CallTracker(ids)
        self.text = ""
        # How much of the text has gone out as content.
        self.content_sent = 0

    def feed(self, delta: str) -> Step:
        """The content and call pieces that `delta` (the next piece of output) makes certain."""
        self.text += delta
        return self.scan(final=False)

    def end(self) -> Step:
        """What is left once the output is complete: text held back because it might have begun a call,
        and, when no call came of it, all the text not sent yet (the output was not calls after all)."""
        step = self.scan(final=True)
        if not self.tracker.sent and self.content_sent < len(self.text):
            step.content += self.text[self.content_sent :]
            self.content_sent = len(self.text)
        return step

    def content_before(self, marker: str, final: bool, step: Step) -> int:
        """Put the text before the first `marker` into `step` as content, holding back a tail that may be the
        start of the marker unless `final`; returns where the marker starts, or -1."""
        text = self.text
        first = text.find(marker)
        if first == -1:
            upto = len(text) if final else len(text) - partial_overlap(text, marker)
        else:
            upto = first
        if upto > self.content_sent:
            step.content = text[self.content_sent : upto]
            self.content_sent = upto
        return first

    @abstractmethod
    def scan(self, final: bool) -> Step:
        """Look at the whole output so far and return what has not been sent yet."""

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and tool calls of a complete output (a fresh parser)."""
        step = self.feed(text)
        step.extend(self.end())
        calls = assemble(step.calls)
        if not calls:
            return (text or None), []
        for call in calls:
            try:
                call.function.arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
            except ValueError:
                # vLLM answers output it cannot read whole as plain content, not as a broken call.
                return (text or None), []
        return (step.content or None), calls


def assemble(pieces: list[DeltaToolCall]) -> list[ToolCall]:
    """Whole tool calls from their streamed pieces, as a client's stream helper assembles them."""
    calls: dict[int, ToolCall] = {}
    for p in pieces:
        fn = p.function or DeltaFunctionCall()
        call = calls.get(p.index)
        if call is None:
            call = calls[p.index] = ToolCall(p.id or "", FunctionCall(fn.name or "", ""))
        call.function.arguments += fn.arguments or ""
    return [calls[i] for i in sorted(calls)]
