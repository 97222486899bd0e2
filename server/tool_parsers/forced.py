"""Output that structured decoding made into tool calls: `tool_choice: "required"` (a JSON array of
{"name", "parameters"}) and a named function (the output is that function's arguments), as vLLM reads them."""

from __future__ import annotations

import json

from schemas.openai import FunctionCall, ToolCall
from server.tool_parsers.base import CallIds, Step, ToolParser, assemble
from server.tool_parsers.partial_json import NotJSON, member_string, member_text, scan_object, skip_ws


class RequiredParser(ToolParser):
    """`[{"name": ..., "parameters": {...}}, ...]`: each element is one call."""

    def __init__(self, ids: CallIds) -> None:
        super().__init__(ids)
        self._broken = False

    def scan(self, final: bool) -> Step:
        """Every element so far; nothing of the output is content."""
        step = Step()
        text = self.text
        pos = skip_ws(text, 0)
        if self._broken or not text.startswith("[", pos):
            return step
        pos, index = skip_ws(text, pos + 1), 0
        try:
            while pos < len(text) and text[pos] == "{":
                obj = scan_object(text, pos)
                raw = member_text(text, obj.get("parameters"))
                step.calls.extend(self.tracker.update(index, member_string(text, obj.get("name")), raw))
                if obj.end is None:
                    break
                index += 1
                pos = skip_ws(text, obj.end)
                if text.startswith(",", pos):
                    pos = skip_ws(text, pos + 1)
        except NotJSON:
            self._broken = True
        return step

    def end(self) -> Step:
        """Nothing held back: the output is never content."""
        return self.scan(final=True)

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The calls of the array (none if it does not parse), arguments re-encoded; content is None."""
        try:
            items = json.loads(text)
        except ValueError:
            return None, []
        if not isinstance(items, list):
            return None, []
        calls: list[ToolCall] = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None, []
            args = json.dumps(item.get("parameters", {}), ensure_ascii=False)
            calls.append(ToolCall(self.ids(len(calls)), FunctionCall(item["name"], args)))
        return None, calls


class NamedParser(ToolParser):
    """The whole output is the arguments of one call to `function`."""

    def __init__(self, ids: CallIds, function: str) -> None:
        super().__init__(ids)
        self.function = function

    def scan(self, final: bool) -> Step:
        """The call's first piece once any output came, then the output as its arguments."""
        text = self.text.lstrip()
        if not text:
            return Step()
        return Step(calls=self.tracker.update(0, self.function, text))

    def end(self) -> Step:
        """Nothing held back: the output is never content."""
        return self.scan(final=True)

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """One call whose arguments are the output (none for an empty output); content is None."""
        step = self.feed(text)
        calls = assemble(step.calls)
        for call in calls:
            call.function.arguments = call.function.arguments.strip()
        return None, calls
