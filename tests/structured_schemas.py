"""JSON Schemas as clients bring them, for the structured-output tests: pydantic models (plain and in OpenAI's
strict form) and hand-written schemas (OpenAI strict mode, tool calls, older drafts, every keyword)."""

from __future__ import annotations

import datetime as dt
import enum
import uuid
from ipaddress import IPv4Address
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, EmailStr, Field, HttpUrl

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
