"""The shipped hermes template: tools, assistant tool calls and tool results render token for token as
transformers renders them (from the messages vLLM would build), and plain chats as the model's own template."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from schemas.openai import ChatCompletionRequest
from schemas.settings import DEFAULT_MODEL_NAME
from server.model_files import ModelFiles, ModelFilesError
from server.preprocess import chat_messages
from server.templates import chat_template_text, shipped_path
from server.tools import plan
from tests.unit.test_model_files import CONVERSATIONS

WEATHER_FN: dict[str, Any] = {
    "name": "get_weather",
    "description": "Current weather in a city — °C, «quoted» & <b>",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city"],
    },
}
WEATHER = {"type": "function", "function": WEATHER_FN}
TIME = {"type": "function", "function": {"name": "get_time", "strict": True}}

# OpenAI-shaped requests (what clients send): arguments are JSON text.
TOOL_LOOP: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
    {"role": "assistant", "content": "It is 18 °C.", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}
    ]},
    {"role": "tool", "tool_call_id": "call_3", "content": "20"},
]  # fmt: skip
NO_SYSTEM = TOOL_LOOP[1:]


@pytest.fixture(scope="module")
def hermes(model_path: Path) -> ModelFiles:
    return ModelFiles.load(model_path, DEFAULT_MODEL_NAME, chat_template_text("hermes"))


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def vllm_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM hands transformers for the same request: arguments as objects, content "" for none."""
    out = copy.deepcopy(messages)
    for m in out:
        if m["content"] is None:
            m["content"] = ""
        for tc in m.get("tool_calls", []):
            tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
    return out


def request(messages: list[dict[str, Any]], **fields: Any) -> ChatCompletionRequest:
    body = {"model": DEFAULT_MODEL_NAME, "messages": messages, **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", ["tool_loop", "no_system"])
@pytest.mark.parametrize("tools", [[WEATHER, TIME], None])
def test_tool_conversations_match_transformers(
    hermes: ModelFiles, hf_tokenizer: Any, conversation: str, tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> None:  # fmt: skip
    messages = TOOL_LOOP if conversation == "tool_loop" else NO_SYSTEM
    req = request(messages, tools=tools, tool_choice="required" if tools else None)
    tool_dicts = plan(req, "hermes").tools
    text = hermes.render_chat(chat_messages(req), add_generation_prompt, tool_dicts)

    # vLLM's tool dicts: description and parameters present (null when not given), strict only when set.
    expected_tools = None
    if tools:
        expected_tools = [
            {"type": "function", "function": {"name": "get_weather", "description": WEATHER_FN["description"],
             "parameters": WEATHER_FN["parameters"]}},
            {"type": "function", "function": {"name": "get_time", "description": None, "parameters": None,
             "strict": True}},
        ]  # fmt: skip
    assert tool_dicts == expected_tools
    kwargs = dict(
        tools=expected_tools, chat_template=hermes.chat_template, add_generation_prompt=add_generation_prompt
    )
    expected_text = hf_tokenizer.apply_chat_template(vllm_messages(messages), tokenize=False, **kwargs)
    expected_ids = hf_tokenizer.apply_chat_template(
        vllm_messages(messages), tokenize=True, return_dict=False, **kwargs
    )

    assert text == expected_text
    assert hermes.encode(text, add_special_tokens=False) == list(expected_ids)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
        in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp": 18}\n</tool_response>\n<tool_response>\n12:00' in text
    if tools:
        assert '"description": "Current weather in a city — °C, «quoted» & <b>"' in text


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_plain_chats_render_as_the_models_own_template(
    hermes: ModelFiles, model_path: Path, hf_tokenizer: Any, conversation: str
) -> None:
    own = ModelFiles.load(model_path, DEFAULT_MODEL_NAME)
    messages = CONVERSATIONS[conversation]
    for add in (True, False):
        assert hermes.render_chat(messages, add) == own.render_chat(messages, add)
        assert hermes.render_chat(messages, add) == hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add
        )


def test_malformed_arguments_in_history_render_as_an_empty_object(hermes: ModelFiles) -> None:
    # As vLLM does: a broken call in the history must not make every later turn fail.
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                               "function": {"name": "f", "arguments": "{oops"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "x"},
    ]  # fmt: skip
    text = hermes.render_chat(chat_messages(request(messages)))
    assert '{"name": "f", "arguments": {}}' in text


def test_chat_template_flag_takes_a_file_a_shipped_name_or_text(tmp_path: Path) -> None:
    source = shipped_path("hermes").read_text(encoding="utf-8")
    assert chat_template_text("hermes") == source
    own = tmp_path / "t.jinja"
    own.write_text("{{ messages[0].content }}", encoding="utf-8")
    assert chat_template_text(str(own)) == "{{ messages[0].content }}"
    assert chat_template_text("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    with pytest.raises(ModelFilesError, match="no file"):
        chat_template_text(str(tmp_path / "missing.jinja"))
