"""Output text that satisfies a structured-output constraint, for the simulated engine.

`structured_text(constraint, seed)` is a pure function of the constraint and the seed, so every worker
(and a migrated request's next worker) produces the same text for the same request. Supported: JSON
schemas (see json_gen), any JSON object, choices, and regexes in the subset regex_gen handles; EBNF
grammars are refused. A refusal is a StructuredUnsupported naming the request field.
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

from schemas.kafka import StructuredOutput
from workers.structured.json_check import SchemaUnsupported
from workers.structured.json_gen import schema_instance
from workers.structured.regex_gen import RegexUnsupported, regex_string

# A free-form object of a few keys: what `response_format: {"type": "json_object"}` gets.
_ANY_OBJECT = {"type": "object"}


class StructuredUnsupported(ValueError):
    """A constraint the simulated engine cannot honour; `field` names it as vLLM's request does."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{field} is not supported by the simulated engine: {reason}")
        self.field = field


def structured_text(constraint: StructuredOutput, seed: int) -> str:
    """Text valid for `constraint` (compact JSON for JSON kinds), a function of `constraint` and `seed`."""
    rng = random.Random(seed)
    if constraint.json_schema is not None:
        try:
            return _dump(schema_instance(_load_schema(constraint.json_schema), rng))
        except SchemaUnsupported as e:
            raise StructuredUnsupported("json", str(e)) from e
    if constraint.json_object:
        return _dump(schema_instance(_ANY_OBJECT, rng))
    if constraint.choice is not None:
        if not constraint.choice:
            raise StructuredUnsupported("choice", "the list of choices is empty")
        return rng.choice(constraint.choice)
    if constraint.regex is not None:
        try:
            return regex_string(constraint.regex, rng)
        except RegexUnsupported as e:
            raise StructuredUnsupported("regex", str(e)) from e
    if constraint.grammar is not None:
        raise StructuredUnsupported("grammar", "grammars are not generated, only JSON, choices and regexes")
    raise StructuredUnsupported("json", "the constraint sets no kind")


@functools.lru_cache(maxsize=256)
def _load_schema(text: str) -> Any:
    # Load tests repeat the same few schemas: parse each once. Callers never mutate the result.
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SchemaUnsupported(f"the schema is not JSON: {e}") from e


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
