"""Llama 3.x JSON tool calls: the output is `{"name": ..., "parameters": {...}}` (or "arguments"),
calls separated by `;`, optionally after the python tag token (vLLM's `llama3_json` parser)."""

from __future__ import annotations

from server.tool_parsers.base import CallIds, Step, ToolParser
from server.tool_parsers.partial_json import NotJSON, member_string, member_text, scan_object, skip_ws

BOT = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    """An output that starts with `{` (or the python tag) is calls; any other output is content."""

    keeps_special_tokens = True

    def __init__(self, ids: CallIds) -> None:
        super().__init__(ids)
        self._mode: str | None = None  # "content" or "calls", once the first characters decide

    def _decide(self, final: bool) -> None:
        text = self.text.lstrip()
        if text.startswith(BOT) or text.startswith("{"):
            self._mode = "calls"
        elif final or (text and not BOT.startswith(text)):
            self._mode = "content"

    def scan(self, final: bool) -> Step:
        """Content passes through; calls are the objects one after another."""
        if self._mode is None:
            self._decide(final)
        if self._mode is None:
            return Step()
        text = self.text
        if self._mode == "content":
            step = Step(text[self.content_sent :])
            self.content_sent = len(text)
            return step
        step = Step()
        pos = skip_ws(text, 0)
        if text.startswith(BOT, pos):
            pos = skip_ws(text, pos + len(BOT))
        index = 0
        while pos < len(text) and text[pos] == "{":
            try:
                obj = scan_object(text, pos)
            except NotJSON:
                break
            args = obj.get("parameters") or obj.get("arguments")
            step.calls.extend(
                self.tracker.update(index, member_string(text, obj.get("name")), member_text(text, args))
            )
            if obj.end is None:
                break
            index += 1
            pos = skip_ws(text, obj.end)
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
        return step
