"""Mistral tool calls after the `[TOOL_CALLS]` token (vLLM's `mistral` parser), in both of its formats:
`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11) and
`[TOOL_CALLS]name[ARGS]{...}` or `[TOOL_CALLS]name{...}`, repeated for each call (v11 and later)."""

from __future__ import annotations

import hashlib
import string

from server.tool_parsers.base import CallIds, Step, ToolParser
from server.tool_parsers.partial_json import (
    NotJSON,
    member_string,
    member_text,
    scan_object,
    skip_ws,
    value_end,
)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ALNUM = string.ascii_letters + string.digits


def mistral_id(seed: str) -> str:
    """A call id as Mistral's templates require: 9 letters and digits (derived from `seed`)."""
    digest = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    return "".join(_ALNUM[b % len(_ALNUM)] for b in digest[:9])


class MistralParser(ToolParser):
    """Content is the text before the first `[TOOL_CALLS]`."""

    keeps_special_tokens = True

    def __init__(self, ids: CallIds) -> None:
        super().__init__(ids)
        self._broken = False

    def scan(self, final: bool) -> Step:
        """Content up to the marker, then the calls in whichever format follows it."""
        text = self.text
        step = Step()
        first = self.content_before(BOT, final, step)
        if first == -1 or self._broken:
            return step
        try:
            pos = skip_ws(text, first + len(BOT))
            if text.startswith("[", pos):
                self._array(text, pos + 1, step)
            else:
                self._named(text, first, step)
        except NotJSON:
            self._broken = True
        return step

    def _array(self, text: str, pos: int, step: Step) -> None:
        index = 0
        pos = skip_ws(text, pos)
        while pos < len(text) and text[pos] == "{":
            obj = scan_object(text, pos)
            args = obj.get("arguments")
            raw = member_text(text, args)
            step.calls.extend(self.tracker.update(index, member_string(text, obj.get("name")), raw))
            if obj.end is None:
                return
            index += 1
            pos = skip_ws(text, obj.end)
            if text.startswith(",", pos):
                pos = skip_ws(text, pos + 1)

    def _named(self, text: str, first: int, step: Step) -> None:
        index = 0
        pos = first
        while pos != -1:
            start = pos + len(BOT)
            brace = text.find("{", start)
            marker = text.find(ARGS, start)
            if marker != -1 and (brace == -1 or marker < brace):
                name, args_at = text[start:marker].strip(), skip_ws(text, marker + len(ARGS))
            elif brace != -1:
                name, args_at = text[start:brace].strip(), brace
            else:
                return  # the name is still arriving
            if not name or args_at >= len(text):
                step.calls.extend(self.tracker.update(index, name or None, None))
                return
            end = value_end(text, args_at)
            step.calls.extend(self.tracker.update(index, name, text[args_at : end or len(text)]))
            if end is None:
                return
            index += 1
            pos = text.find(BOT, end)
