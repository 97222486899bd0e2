"""Chat templates shipped with Ferry, and finding the one `--chat-template` names.

`hermes.jinja` is ChatML (`<|im_start|>role\\n...<|im_end|>\\n`) with tools in the Hermes / Qwen 2.5 format:
the tools listed in `<tools></tools>` in the system turn, calls as `<tool_call>{"name", "arguments"}</tool_call>`,
results in `<tool_response>` inside a user turn. A conversation without tools renders exactly as the default
model's (SmolLM2's) own template renders it, so it can serve that model, whose template cannot show tools.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from server.model_files import ModelFilesError

SHIPPED = ("hermes",)


def shipped_path(name: str) -> Path:
    """Where the shipped template `name` is (a file inside the installed package)."""
    return Path(str(resources.files(__package__).joinpath(f"{name}.jinja")))


def chat_template_text(value: str) -> str:
    """The template `--chat-template` names, as vLLM's flag reads it: a file, else a template shipped with
    Ferry by name, else the template text itself."""
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if value in SHIPPED:
        return shipped_path(value).read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ModelFilesError(
        f"--chat-template {value!r} is no file, no template shipped with Ferry ({', '.join(SHIPPED)}) and no "
        "template text"
    )
