"""Tool fields of a chat request: what is refused (a 400 naming the field), and what the rest becomes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.batch import ItemMeta
from schemas.kafka import Chunk, ChunkUsage
from schemas.openai import chat_request_decoder
from schemas.streams import ToolCallMode
from server.batch.lines import ItemChunks, build
from server.errors import APIError
from server.http import decode
from server.tools import plan, schema_problem

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def planned(parser: str = "hermes", **fields: Any) -> Any:
    body = {"model": "m", "messages": USER, **fields}
    return plan(decode(chat_request_decoder, json.dumps(body).encode()), parser)


def refused(parser: str = "hermes", **fields: Any) -> APIError:
    with pytest.raises(APIError) as err:
        planned(parser, **fields)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER, {"type": "custom", "custom": {"name": "x"}}]}, "tools[1].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "custom", "function": {"name": "x"}}}, "tool_choice.type"),
        ({"messages": [{"role": "tool", "content": "18"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [*USER, {"role": "assistant", "tool_calls": [
            {"id": "a", "type": "file_search", "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[1].tool_calls[0].type"),
    ],
)  # fmt: skip
def test_malformed_fields_are_refused_by_name(fields: dict[str, Any], param: str) -> None:
    assert refused(**fields).param == param


def test_tool_choice_naming_no_tool() -> None:
    err = refused(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert err.param == "tool_choice" and "get_time" in err.message


def test_tool_choice_without_tools_and_empty_tools() -> None:
    assert refused(tool_choice="required").param == "tool_choice"
    assert refused(tools=[]).param == "tools"
    assert planned(tool_choice="none").tools is None


def test_a_tool_message_must_answer_an_earlier_call() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}  # fmt: skip
    answer = {"role": "tool", "tool_call_id": "call_1", "content": "18"}
    stray = {"role": "tool", "tool_call_id": "call_9", "content": "18"}
    assert planned(messages=[*USER, call, answer], tools=[WEATHER]).mode is not None
    assert refused(messages=[*USER, call, answer, stray], tools=[WEATHER]).param == "messages[3].tool_call_id"
    # An answer before its call answers nothing yet.
    assert refused(messages=[*USER, answer, call]).param == "messages[1].tool_call_id"


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "objekt"},
        {"type": "object", "properties": {"city": {"type": "str"}}},
        {"type": "object", "properties": []},
        {"type": "object", "required": "city"},
        {"type": "array", "items": {"minItems": -1}},
        {"anyOf": []},
        {"type": "string", "pattern": "(unclosed"},
        ["not", "an", "object"],
    ],
)
def test_an_invalid_parameters_schema_is_refused_naming_the_tool(parameters: Any) -> None:
    bad = {"type": "function", "function": {"name": "broken", "parameters": parameters}}
    err = refused(tools=[WEATHER, bad])
    assert err.param == "tools[1].function.parameters"
    if isinstance(parameters, dict):
        assert "'broken'" in err.message


def test_valid_schemas_pass() -> None:
    schema = {
        "type": "object",
        "properties": {
            "when": {"type": ["string", "null"], "format": "date-time"},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3},
            "n": {"type": "integer", "minimum": 0, "exclusiveMaximum": 10.5},
        },
        "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$"}},
        "additionalProperties": False,
        "x-unknown-keyword": {"whatever": 1},
    }
    assert schema_problem(schema) is None


def test_auto_needs_a_parser_as_vllm_does() -> None:
    # tools without tool_choice mean "auto".
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        err = refused("", **fields)
        assert err.param == "tool_choice"
        assert err.message.startswith(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'
        )
    p = planned("mistral", tools=[WEATHER])
    assert p.mode.choice == "auto" and p.mode.parser == "mistral" and p.keep_special_tokens
    assert p.structured is None


def test_none_still_shows_the_tools_and_forces_nothing() -> None:
    p = planned("", tools=[WEATHER], tool_choice="none")
    assert p.tools and p.mode is None and p.structured is None


def test_required_is_an_array_of_calls_to_the_tools() -> None:
    defs_tool = {"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"t": {"$ref": "#/$defs/t"}}, "$defs": {"t": {"type": "string"}}}}}  # fmt: skip
    p = planned("", tools=[WEATHER, TIME, defs_tool], tool_choice="required", parallel_tool_calls=False)
    assert p.mode.choice == "required" and not p.mode.parallel
    schema = json.loads(p.structured.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"], ["tag"]]
    # A tool without parameters still takes an object; $defs move to the top, where references land.
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == {"t": {"type": "string"}}
    assert "$defs" not in schema["items"]["anyOf"][2]["properties"]["parameters"]
    assert schema_problem(schema) is None


def test_named_is_the_functions_parameters() -> None:
    p = planned(
        "", tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert p.mode.choice == "named" and p.mode.function == "get_weather"
    assert json.loads(p.structured.json_schema) == WEATHER["function"]["parameters"]  # type: ignore[index]


def test_a_batch_line_carries_the_tool_calls() -> None:
    # A batch item's output line is the same body the route answers: tool calls and their finish reason.
    meta = ItemMeta(
        custom_id="c", endpoint="/v1/chat/completions", model="m", prompt_lens=[5],
        tools=ToolCallMode("required"),
    )  # fmt: skip
    item = ItemChunks(first_offset=0)
    item.add(0, Chunk("i/0", 0, [1], '[{"name": "get_weather", ', worker_id="w"))
    item.add(0, Chunk("i/0", 1, [2], '"parameters": {"city": "Paris"}}]', finish_reason="stop",
                      usage=ChunkUsage(5, 2), worker_id="w"))  # fmt: skip
    body = json.loads(build(meta, item, None).body)  # type: ignore[arg-type]
    [choice] = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_a_schema_nested_too_deeply_is_a_400_not_a_crash() -> None:
    deep = '{"not":' * 5000 + "{}" + "}" * 5000
    body = (
        '{"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required", '
        '"tools": [{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}]}"
    )
    with pytest.raises(APIError) as err:
        plan(decode(chat_request_decoder, body.encode()), "")
    assert err.value.status == 400
