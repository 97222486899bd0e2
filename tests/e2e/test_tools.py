"""Tool calling as a client meets it: `ferry up` (sim workers, the shipped hermes template and parser) and
the official openai client, streamed and whole, through a whole tool loop."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
import pytest_asyncio
from openai.types.chat import (
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)

from launch.services import Child

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string", "maxLength": 12}}, "required": ["tz"]}}},
]  # fmt: skip
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest_asyncio.fixture(scope="module")
async def stack(model_path: Path) -> AsyncIterator[str]:
    """`ferry up` with the tool-capable template and its parser; yields the base URL."""
    child = await Child.spawn(
        "ferry-up-tools",
        [sys.executable, "-m", "launch", "up", "--port", "0", "--workers", "1", "--speedup", "20",
         "--model-path", str(model_path), "--heartbeat-interval-s", "0.5",
         "--chat-template", "hermes", "--tool-call-parser", "hermes"],
        echo=False,
    )  # fmt: skip
    line = await child.wait_for_line(lambda ln: ln.startswith("ferry-ready "), 120)
    yield line.split()[1]
    assert await child.stop(30) == 0, "\n".join(child.tail)


@pytest_asyncio.fixture
async def client(stack: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def function_calls(message: ChatCompletionMessage) -> list[ChatCompletionMessageFunctionToolCall]:
    calls = message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls)
    return calls  # type: ignore[return-value]


def schema_of(name: str) -> dict[str, Any]:
    return next(t["function"].get("parameters", {}) for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("tool_choice", ["required", "named"])
async def test_forced_call_whole_and_streamed_agree(client: openai.AsyncOpenAI, tool_choice: str) -> None:
    choice: Any = NAMED if tool_choice == "named" else "required"
    whole = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=7, max_tokens=200
    )
    message = whole.choices[0].message
    calls = function_calls(message)
    assert message.content is None and calls
    # OpenAI's and vLLM's rule: a named tool_choice finishes with "stop", the others with "tool_calls".
    assert whole.choices[0].finish_reason == ("stop" if tool_choice == "named" else "tool_calls")
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))
    if tool_choice == "named":
        assert [c.function.name for c in calls] == ["get_weather"]

    stream = await client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, seed=7, max_tokens=200, stream=True
    )
    chunks = [c async for c in stream]
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    firsts = {}
    args: dict[int, str] = {}
    for d in deltas:
        if d.index not in firsts:
            assert d.id and d.type == "function" and d.function and d.function.name
            firsts[d.index] = (d.id, d.function.name)
        else:
            assert d.id is None and d.function and d.function.name is None
        args[d.index] = args.get(d.index, "") + (d.function.arguments or "" if d.function else "")
    # How many pieces depends on how many tokens reached the frontend together (a stream that is not
    # resumable merges them); the pieces themselves are tested in tests/unit/test_tool_parsers.py.
    # Same seed, same calls (ids differ: they are the request's).
    assert [firsts[i][1] for i in sorted(firsts)] == [c.function.name for c in calls]
    assert len({firsts[i][0] for i in firsts}) == len(firsts)
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.function.arguments) for c in calls]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


async def test_sdk_stream_helper_assembles_tool_calls(client: openai.AsyncOpenAI) -> None:
    async with client.chat.completions.stream(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=3, max_tokens=200
    ) as stream:
        done = [e async for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and final.choices[0].finish_reason == "tool_calls"
    assert [(e.name, e.arguments) for e in done] == [(c.function.name, c.function.arguments) for c in calls]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schema_of(call.function.name))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_whole_tool_loop(client: openai.AsyncOpenAI, stream: bool) -> None:
    messages: list[Any] = list(ASK)
    # 1. The model calls the tool.
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=NAMED, max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    # 2. The client runs it and sends the result back; 3. the model answers (auto: the sim writes text).
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18})})
    if stream:
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=12, stream=True)]  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        final = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=12
        )
        text, reason = final.choices[0].message.content or "", final.choices[0].finish_reason
        assert final.choices[0].message.tool_calls is None
    assert text and reason == "length"
    # A tool result must answer a call the conversation made.
    messages[-1] = {"role": "tool", "tool_call_id": "call_unknown", "content": "18"}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=12)
    assert err.value.body["param"] == "messages[2].tool_call_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
         "tools[0].function.parameters"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0].type"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "1"}]}, "messages[1].tool_call_id"),
    ],
)  # fmt: skip
async def test_bad_tool_input_is_a_400_with_param(
    client: openai.AsyncOpenAI, fields: dict[str, Any], param: str
) -> None:
    body: Any = {"model": MODEL, "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(**body)
    assert err.value.status_code == 400 and err.value.body["param"] == param  # type: ignore[index]
