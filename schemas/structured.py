"""Structured-output requests as clients send them: OpenAI's `response_format` and vLLM's `structured_outputs`.

The frontend turns either into the one `StructuredOutput` a worker takes (schemas/kafka.py).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

# OpenAI's rule for a response format's name.
SchemaName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]+$", max_length=64)]


class JSONSchemaSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`response_format.json_schema`: a named JSON Schema, as the OpenAI SDK's `.parse()` sends it."""

    name: SchemaName
    description: str | None = None
    # Checked against the JSON Schema meta-schema when the request is prepared (server/structured_request.py).
    schema: Any = None
    # Constrained decoding always produces schema-valid output, so `strict` false or true both get it.
    strict: bool | None = None


class TextFormat(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """`{"type": "text"}`: no constraint."""


class JSONObjectFormat(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    """`{"type": "json_object"}`: any JSON object."""


class JSONSchemaFormat(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    """`{"type": "json_schema", "json_schema": {...}}`: JSON valid for the schema."""

    json_schema: JSONSchemaSpec


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaFormat


class StructuredOutputsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request extension: exactly one constraint."""

    # A JSON Schema, as an object or as JSON text (vLLM takes both).
    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's backend options: accepted at their defaults only (server/structured_request.py says why).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None
