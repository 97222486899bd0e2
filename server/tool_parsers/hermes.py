"""Hermes / Qwen 2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
them, after optional text (vLLM's `hermes` parser)."""

from __future__ import annotations

from server.tool_parsers.base import CallIds, Step, ToolParser
from server.tool_parsers.partial_json import NotJSON, member_string, member_text, scan_object, skip_ws

START = "<tool_call>"
END = "</tool_call>"


class HermesParser(ToolParser):
    """Content is the text before the first `<tool_call>`; each tag holds one call as JSON."""

    # Tool-call tags are special tokens in some models' vocabularies: keep them in the output text.
    keeps_special_tokens = True

    def __init__(self, ids: CallIds) -> None:
        super().__init__(ids)
        # Calls whose JSON could not be read: no more pieces for them (or for later ones).
        self._broken = False

    def scan(self, final: bool) -> Step:
        """Content up to the first tag (holding back a possible partial tag), then every tagged call."""
        text = self.text
        step = Step()
        first = self.content_before(START, final, step)
        if first == -1 or self._broken:
            return step
        pos, index = first, 0
        while pos != -1:
            body = skip_ws(text, pos + len(START))
            close = text.find(END, body)
            region = text[: close if close != -1 else len(text)]
            if body >= len(region):
                break
            try:
                obj = scan_object(region, body)
            except NotJSON:
                self._broken = True
                break
            step.calls.extend(
                self.tracker.update(
                    index, member_string(region, obj.get("name")), member_text(region, obj.get("arguments"))
                )
            )
            if close == -1:
                break
            index += 1
            pos = text.find(START, close + len(END))
        return step
