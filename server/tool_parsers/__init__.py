"""Tool-call parsers: reading tool calls out of a model's output, streamed and whole.

`--tool-call-parser` picks the one for the model's own format (used with `tool_choice: "auto"`); the
forced parsers read what structured decoding produced for `"required"` and a named function.
"""

from __future__ import annotations

import hashlib

from schemas.streams import ToolCallMode
from server.tool_parsers.base import ToolParser, assemble
from server.tool_parsers.forced import NamedParser, RequiredParser
from server.tool_parsers.hermes import HermesParser
from server.tool_parsers.llama3_json import Llama3JsonParser
from server.tool_parsers.mistral import MistralParser, mistral_id

# The names `--tool-call-parser` takes, as vLLM names them.
PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def call_id(seed: str, style: str = "") -> str:
    """A tool call id derived from `seed` (request id, choice, index): vLLM's `chatcmpl-tool-<hex>` form,
    or Mistral's 9 alphanumerics."""
    if style == "mistral":
        return mistral_id(seed)
    return "chatcmpl-tool-" + hashlib.blake2b(seed.encode(), digest_size=16).hexdigest()


def parser_for(mode: ToolCallMode, request_id: str, choice: int) -> ToolParser:
    """A fresh parser for one choice of a request."""
    style = "mistral" if mode.choice == "auto" and mode.parser == "mistral" else ""

    def ids(index: int) -> str:
        return call_id(f"{request_id}/{choice}/{index}", style)

    if mode.choice == "required":
        return RequiredParser(ids)
    if mode.choice == "named":
        return NamedParser(ids, mode.function)
    return PARSERS[mode.parser](ids)


__all__ = ["PARSERS", "ToolParser", "assemble", "call_id", "parser_for"]
