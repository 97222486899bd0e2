"""JSON instances for JSON Schemas: valid (checked by the jsonschema library and by pydantic), deterministic,
word-shaped and small; refusals name the reason."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

from schemas.kafka import StructuredOutput
from tests.structured_schemas import MODELS, SCHEMAS, TOOL_CALLS, MathReasoning, Person
from workers.structured import StructuredUnsupported, structured_text
from workers.structured.json_check import SchemaUnsupported
from workers.structured.json_gen import schema_instance
from workers.structured.words import WORDS

SEEDS = range(30)


def _validator(schema: Any) -> jsonschema.protocols.Validator:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _text(schema: Any, seed: int) -> str:
    return structured_text(StructuredOutput(json_schema=json.dumps(schema)), seed)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *_strings(v)]]
    return []


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_hand_written_schemas_give_valid_compact_instances(name: str) -> None:
    schema = SCHEMAS[name]
    validator = _validator(schema)
    for seed in SEEDS:
        text = _text(schema, seed)
        value = json.loads(text)
        validator.validate(value)
        assert text == json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_pydantic_models_parse_what_is_generated(model: type[BaseModel]) -> None:
    for schema in (model.model_json_schema(), to_strict_json_schema(model)):
        validator = _validator(schema)
        for seed in SEEDS:
            text = _text(schema, seed)
            validator.validate(json.loads(text))
            # What `client.chat.completions.parse()` does with the answer.
            model.model_validate_json(text)


def test_same_seed_same_text_and_seeds_vary() -> None:
    schema = Person.model_json_schema()
    assert _text(schema, 7) == _text(schema, 7)
    assert len({_text(schema, seed) for seed in SEEDS}) == len(SEEDS)


def test_strings_are_short_phrases_of_words() -> None:
    words = set(WORDS)
    for seed in SEEDS:
        value = json.loads(_text(SCHEMAS["openai_strict"], seed))
        for s in _strings(value):
            assert s in value or 1 <= len(s) <= 24  # keys are declared names
            if s not in ("steps", "explanation", "output", "final_answer"):
                assert all(w in words for w in s.split(" ")), s
    sizes = [len(_text(MathReasoning.model_json_schema(), seed)) for seed in SEEDS]
    assert max(sizes) < 600 and sum(sizes) / len(sizes) > 40


def test_tool_call_arrays_name_their_functions() -> None:
    names = set()
    for seed in SEEDS:
        calls = json.loads(_text(TOOL_CALLS, seed))
        assert 1 <= len(calls) <= 3
        names |= {c["name"] for c in calls}
    assert names == {"get_weather", "search"}


def test_optional_values_are_mostly_present() -> None:
    present = sum(
        json.loads(_text(SCHEMAS["openai_strict"], seed))["final_answer"] is not None for seed in range(100)
    )
    assert 60 <= present <= 95


REFUSED: dict[str, tuple[Any, str]] = {
    "if_then_else": ({"if": {"type": "string"}, "then": {"minLength": 2}}, "'if'"),
    "remote_ref": ({"$ref": "https://example.com/schema.json"}, "only references inside the schema"),
    "dangling_ref": ({"$ref": "#/$defs/missing"}, "names nothing"),
    "false": (False, "accepts nothing"),
    "lengths": ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    "lookahead_only": ({"type": "string", "pattern": "^(?=a)ab$"}, "pattern"),
    "endless_recursion": (
        {
            "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
            "$ref": "#/$defs/a",
        },
        "recurses",
    ),
    "ref_cycle": ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "refers to itself"),
    "huge_array": ({"type": "array", "minItems": 10**6}, "minItems"),
    "no_integer_between": ({"type": "integer", "minimum": 1.5, "maximum": 1.7}, "no integer"),
    "enum_against_type": ({"type": "string", "enum": [1, 2]}, "enum"),
    "disjoint_types": ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "no value has both"),
    "required_forbidden": ({"type": "object", "required": ["a"], "additionalProperties": False}, "'a'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_or_unsatisfiable_schemas_are_refused(name: str) -> None:
    schema, reason = REFUSED[name]
    with pytest.raises(StructuredUnsupported) as info:
        _text(schema, 0)
    assert str(info.value).startswith("structured_outputs.json is not supported by the simulated engine")
    assert reason in str(info.value)
    assert info.value.field == "json"


def test_generator_raises_schema_unsupported_directly() -> None:
    with pytest.raises(SchemaUnsupported):
        schema_instance({"type": "string", "minLength": 10**6}, random.Random(0))


def test_json_object_choice_regex_and_grammar() -> None:
    objects = [json.loads(structured_text(StructuredOutput(json_object=True), seed)) for seed in SEEDS]
    assert all(isinstance(o, dict) and 1 <= len(o) <= 3 for o in objects)
    assert len({json.dumps(o) for o in objects}) == len(objects)
    choices = ["positive", "negative", "neutral"]
    picks = [structured_text(StructuredOutput(choice=choices), seed) for seed in SEEDS]
    assert set(picks) == set(choices)
    assert picks == [structured_text(StructuredOutput(choice=choices), seed) for seed in SEEDS]
    assert structured_text(StructuredOutput(regex=r"\d{3}-[a-z]+"), 1)[3] == "-"
    with pytest.raises(
        StructuredUnsupported, match=r"^structured_outputs.grammar is not supported by the simulated engine"
    ):
        structured_text(StructuredOutput(grammar='root ::= "yes" | "no"'), 0)
    with pytest.raises(
        StructuredUnsupported, match=r"^structured_outputs.regex is not supported.*lookaround|group construct"
    ):
        structured_text(StructuredOutput(regex=r"(?!x)\w+"), 0)
