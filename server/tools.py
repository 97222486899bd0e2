"""Tool calling on the way in: checking `tools`, `tool_choice` and the tool messages of a conversation, and
deciding how the output becomes tool calls.

As vLLM does: `tool_choice` defaults to "auto" when there are tools; "auto" reads the model's own call
format with the parser given by `--tool-call-parser` and is refused without one; "required" and a named
function are enforced by structured decoding (a JSON schema built from the tools, as vLLM's
`get_json_schema_from_tools` builds it), so they work with any model and need no parser; "none" still
shows the tools to the template, which is what vLLM renders too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema

from schemas.kafka import StructuredOutput
from schemas.openai import ChatCompletionRequest, ChatTool, NamedToolChoice
from schemas.streams import ToolCallMode
from server.errors import APIError
from server.tool_parsers import PARSERS


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools change: the template's `tools`, how the output becomes calls, and the
    structured output that forces them."""

    tools: list[dict[str, Any]] | None = None
    mode: ToolCallMode | None = None
    structured: StructuredOutput | None = None
    # The parser's markers may be special tokens: detokenize without skipping them.
    keep_special_tokens: bool = False


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def schema_problem(schema: Any) -> str | None:
    """What makes `schema` no JSON Schema, checked against the meta-schema of the draft it names (2020-12
    when it names none) by jsonschema; None if nothing does."""
    if not isinstance(schema, dict | bool):
        return "the schema must be an object or a boolean"
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"at '{where}': {e.message}" if where else e.message
    return None


def _tool_dict(tool: ChatTool) -> dict[str, Any]:
    # What vLLM hands the template (its model_dump): description and parameters even when null, strict only
    # when given.
    fn = tool.function
    assert fn is not None  # ChatTool refuses a tool without one
    body: dict[str, Any] = {"name": fn.name, "description": fn.description, "parameters": fn.parameters}
    if fn.strict is not None:
        body["strict"] = fn.strict
    return {"type": "function", "function": body}


def _parameters(params: dict[str, Any] | None) -> dict[str, Any]:
    # A function without parameters still takes a JSON object.
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], parallel: bool | None) -> dict[str, Any]:
    """The schema of `tool_choice: "required"` output: an array of {name, parameters} of the tools, one
    item at most when parallel calls are off (vLLM's `_get_json_schema_from_tools`)."""
    items: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        assert fn is not None
        params = dict(_parameters(fn.parameters))
        # $defs move to the top of the combined schema, where the tools' `#/$defs/...` references land.
        for name, sub in (params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != sub:
                raise _bad(f"Tool definition '{name}' has multiple schemas, which is not supported.",
                           f"tools[{i}].function.parameters")  # fmt: skip
            defs[name] = sub
        items.append({
            "properties": {"name": {"type": "string", "enum": [fn.name]}, "parameters": params},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _check_tools(tools: list[ChatTool]) -> None:
    if not tools:
        raise _bad("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                   "entirely.", "tools")  # fmt: skip
    for i, tool in enumerate(tools):
        fn = tool.function
        assert fn is not None
        try:
            problem = schema_problem(fn.parameters) if fn.parameters is not None else None
        except RecursionError:
            problem = "it is nested too deeply"
        if problem:
            raise _bad(f"Invalid JSON schema in the parameters of tool '{fn.name}': {problem}.",
                       f"tools[{i}].function.parameters")  # fmt: skip


def _check_tool_messages(req: ChatCompletionRequest) -> None:
    # OpenAI refuses a tool result that answers no call the assistant made earlier in the conversation.
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.role == "assistant" and m.tool_calls:
            called.update(tc.id for tc in m.tool_calls)
        elif m.role == "tool" and m.tool_call_id not in called:
            raise _bad(
                f"Invalid parameter: the message with role 'tool' answers tool call '{m.tool_call_id}', which "
                "no preceding assistant message made (messages with role 'tool' must be a response to a "
                "preceding message with 'tool_calls').",
                f"messages[{i}].tool_call_id",
            )


def plan(req: ChatCompletionRequest, parser: str) -> ToolPlan:
    """Check a chat request's tool fields against each other and its messages; what they change.

    `parser` is the frontend's `--tool-call-parser` ("" when none). Raises APIError (400) naming the field.
    """
    _check_tool_messages(req)
    tools = req.tools
    choice = req.tool_choice
    if tools is None:
        if choice is not None and choice != "none":
            raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
        return ToolPlan()
    _check_tools(tools)
    dicts = [_tool_dict(t) for t in tools]
    choice = "auto" if choice is None else choice
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(tools=dicts)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        match = next((t for t in tools if t.function is not None and t.function.name == name), None)
        if match is None or match.function is None:
            raise _bad(f"The tool specified in `tool_choice` ('{name}') does not match any of the specified "
                       "`tools`.", "tool_choice")  # fmt: skip
        schema = _parameters(match.function.parameters)
        return ToolPlan(
            tools=dicts,
            mode=ToolCallMode("named", function=name, parallel=parallel),
            structured=StructuredOutput(json_schema=json.dumps(schema)),
        )
    if choice == "required":
        schema = required_schema(tools, req.parallel_tool_calls)
        return ToolPlan(
            tools=dicts,
            mode=ToolCallMode("required", parallel=parallel),
            structured=StructuredOutput(json_schema=json.dumps(schema)),
        )
    if not parser:
        # vLLM's wording, which agent frameworks look for to fall back to prompting for tools.
        raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                   "(start Ferry's frontend with --tool-call-parser).", "tool_choice")  # fmt: skip
    return ToolPlan(
        tools=dicts,
        mode=ToolCallMode("auto", parser=parser, parallel=parallel),
        keep_special_tokens=PARSERS[parser].keeps_special_tokens,
    )
