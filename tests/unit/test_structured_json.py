"""JSON instances for JSON Schemas: valid (checked by the jsonschema library and by pydantic), deterministic,
word-shaped and small; refusals name the reason."""

from __future__ import annotations

import datetime as dt
import enum
import json
import random
import uuid
from ipaddress import IPv4Address
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, ConfigDict, EmailStr, Field, HttpUrl

from schemas.kafka import StructuredOutput
from workers.structured import StructuredUnsupported, structured_text
from workers.structured.json_check import SchemaUnsupported
from workers.structured.json_gen import schema_instance
from workers.structured.words import WORDS

SEEDS = range(30)


# ---- pydantic models as clients write them ------------------------------------------------------


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 5


class Address(BaseModel):
    street: str
    city: str = Field(min_length=2, max_length=20)
    zip: str | None = Field(default=None, pattern=r"^\d{5}(-\d{4})?$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=130)
    email: EmailStr
    tags: list[str] = Field(min_length=1, max_length=4)
    address: Address
    nickname: str | None = None
    kind: Literal["admin", "user"]


class Everything(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flag: bool
    ratio: Annotated[float, Field(gt=0, lt=1)]
    count: Annotated[int, Field(gt=-5, le=-1)]
    step: Annotated[int, Field(multiple_of=7, ge=10, le=60)]
    price: Annotated[float, Field(multiple_of=0.25, ge=1, le=3)]
    when: dt.datetime
    day: dt.date
    at: dt.time
    span: dt.timedelta
    ident: uuid.UUID
    site: HttpUrl
    ip: IPv4Address
    color: Color
    priority: Priority
    scores: dict[str, int]
    pair: tuple[int, str]
    unique: set[int]
    frozen: frozenset[str]
    blob: bytes
    code: Annotated[str, Field(pattern=r"^[A-Z]{3}-\d{4}$")]
    short: Annotated[str, Field(min_length=5, max_length=5)]
    anything: Any
    either: int | str
    matrix: list[list[float]]
    maybe_people: list[Person] | None = None


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Cat | Dog = Field(discriminator="pet_type")
    pets: list[Annotated[Cat | Dog, Field(discriminator="pet_type")]]


class Node(BaseModel):
    value: int
    children: list[Node] = []


class LinkedList(BaseModel):
    head: int
    tail: LinkedList | None


class Step(BaseModel):
    explanation: str
    output: str


class MathReasoning(BaseModel):
    steps: list[Step]
    final_answer: str


class CalendarEvent(BaseModel):
    name: str
    date: str
    participants: list[str]


class Entities(BaseModel):
    attributes: list[str]
    colors: list[str]
    animals: list[str]


class UIComponent(BaseModel):
    type: Literal["div", "button", "header", "section", "field", "form"]
    label: str
    children: list[UIComponent]
    attributes: list[Step]


MODELS: list[type[BaseModel]] = [
    Address,
    Person,
    Everything,
    Owner,
    Node,
    LinkedList,
    MathReasoning,
    CalendarEvent,
    Entities,
    UIComponent,
]


# ---- hand-written schemas: OpenAI strict mode, tool calls, older drafts, every keyword -----------

TOOL_CALLS = {
    "type": "array",
    "minItems": 1,
    "items": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": ["get_weather"]},
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "location": {"type": "string", "description": "City and country"},
                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                        },
                        "required": ["location"],
                    },
                },
                "required": ["name", "parameters"],
            },
            {
                "type": "object",
                "properties": {
                    "name": {"enum": ["search"]},
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string"},
                            "top_k": {"type": "integer", "minimum": 1},
                        },
                        "required": ["query", "top_k"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "parameters"],
            },
        ]
    },
}

SCHEMAS: dict[str, Any] = {
    "tool_calls": TOOL_CALLS,
    "openai_strict": {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}},
                    "required": ["explanation", "output"],
                    "additionalProperties": False,
                },
            },
            "final_answer": {"type": ["string", "null"]},
        },
        "required": ["steps", "final_answer"],
        "additionalProperties": False,
    },
    "draft7_definitions": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "definitions": {
            "item": {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"]}
        },
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/definitions/item"}, "minItems": 2}},
        "required": ["items"],
    },
    "draft4_exclusive": {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "type": "object",
        "properties": {
            "p": {
                "type": "number",
                "minimum": 0,
                "exclusiveMinimum": True,
                "maximum": 1,
                "exclusiveMaximum": True,
            },
            "t": {
                "type": "array",
                "items": [{"type": "integer"}, {"type": "string"}],
                "additionalItems": False,
            },
        },
        "required": ["p", "t"],
    },
    "type_list": {"type": ["string", "integer", "null", "boolean"]},
    "enum_mixed": {"enum": [1, "a", None, True, {"k": [1, 2]}]},
    "enum_typed": {"type": "string", "enum": [1, "a", "b"]},
    "const": {"const": {"x": [1, "two", None]}},
    "pattern_properties": {
        "type": "object",
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
        "minProperties": 2,
    },
    "property_names": {
        "type": "object",
        "propertyNames": {"pattern": "^[a-z]{3,6}$"},
        "additionalProperties": {"type": "boolean"},
    },
    "dict_of_models": {
        "type": "object",
        "additionalProperties": {
            "type": "object",
            "properties": {"n": {"type": "integer"}},
            "required": ["n"],
        },
    },
    "unique_items": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 3, "uniqueItems": True},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}, "minContains": 2},
    "multiple_of": {
        "type": "object",
        "properties": {
            "cents": {"type": "number", "multipleOf": 0.01, "minimum": 0.5, "maximum": 2},
            "weeks": {"type": "integer", "multipleOf": 7, "minimum": 10, "maximum": 30},
        },
        "required": ["cents", "weeks"],
    },
    "not": {"type": "integer", "minimum": 0, "maximum": 5, "not": {"enum": [0, 1, 2, 3]}},
    "one_of": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    "one_of_overlapping": {"oneOf": [{"type": "number"}, {"type": "integer"}]},
    "all_of_ref_siblings": {
        "$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
        "allOf": [
            {"$ref": "#/$defs/base"},
            {"properties": {"name": {"type": "string"}}, "required": ["name"]},
        ],
        "unevaluatedProperties": False,
    },
    "ref_with_siblings": {
        "$defs": {"s": {"type": "string"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 6, "description": "short"}},
        "required": ["a"],
    },
    "nested_arrays": {
        "type": "array",
        "minItems": 2,
        "maxItems": 2,
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "number"}},
    },
    "formats": {
        "type": "object",
        "properties": {
            f: {"type": "string", "format": f}
            for f in (
                "date",
                "date-time",
                "time",
                "email",
                "uri",
                "uuid",
                "ipv4",
                "ipv6",
                "hostname",
                "duration",
            )
        },
        "required": [
            "date",
            "date-time",
            "time",
            "email",
            "uri",
            "uuid",
            "ipv4",
            "ipv6",
            "hostname",
            "duration",
        ],
    },
    "lengths": {
        "type": "object",
        "properties": {
            "long": {"type": "string", "minLength": 30, "maxLength": 40},
            "tiny": {"type": "string", "maxLength": 3},
            "exact": {"type": "string", "minLength": 5, "maxLength": 5},
            "empty": {"type": "string", "maxLength": 0},
        },
        "required": ["long", "tiny", "exact", "empty"],
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{4}$"},
            "phone": {"type": "string", "pattern": "^\\+?[0-9 ]{7,15}$"},
            "slug": {"type": "string", "pattern": "^[a-z0-9]+(?:-[a-z0-9]+)*$", "maxLength": 20},
            "unanchored": {"type": "string", "pattern": "ab+c"},
        },
        "required": ["code", "phone", "slug", "unanchored"],
    },
    "negative_integers": {"type": "integer", "minimum": -5, "maximum": -1},
    "exclusive_number": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001},
    "dependent_required": {
        "type": "object",
        "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
        "required": ["card"],
        "dependentRequired": {"card": ["billing"]},
    },
    "prefix_items": {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "null"}], "items": False},
    "empty": {},
    "true": True,
    "free_object": {"type": "object"},
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "value": {"type": "integer"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["value", "children"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "root_recursion": {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    },
    "no_type_clues": {
        "properties": {"a": {"minimum": 3}, "b": {"items": {"format": "date"}}},
        "required": ["a", "b"],
    },
    "big_enum": {"type": "string", "enum": [f"v{i}" for i in range(200)]},
}


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
