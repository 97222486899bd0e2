"""A small JSON Schema validator for the keywords the instance generator honours, used to check its output.

It is no general validator: `format` is not asserted (an annotation by default), and keywords the
generator refuses (`if`/`then`/`else`, `dependentSchemas`, dynamic references) are not evaluated.
It errs on the side of rejecting, so a generated instance it accepts is valid.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from workers.structured.regex_gen import RegexUnsupported, python_regex

# Keywords that the generator refuses; the validator need not know them.
REFUSED = ("if", "then", "else", "dependentSchemas", "$dynamicRef", "$recursiveRef")


class SchemaUnsupported(ValueError):
    """The schema uses something the generator cannot honour, or no instance could be found."""


def search_regex(pattern: str) -> re.Pattern[str]:
    """A schema's `pattern`, compiled."""
    try:
        return python_regex(pattern)
    except RegexUnsupported as e:
        raise SchemaUnsupported(f"pattern {pattern!r}: {e}") from e


def deref(root: Any, ref: str) -> Any:
    """The subschema a local `$ref` ("#" or "#/json/pointer") names in `root`."""
    if ref != "#" and not ref.startswith("#/"):
        raise SchemaUnsupported(f"$ref {ref!r}: only references inside the schema ('#/...') are supported")
    node = root
    for raw in ref[2:].split("/") if ref != "#" else ():
        part = raw.replace("~1", "/").replace("~0", "~")
        part = re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m[1], 16)), part)
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise SchemaUnsupported(f"$ref {ref!r} names nothing in the schema")
    return node


def json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON has it: true is not 1, 1 is 1.0, and containers compare deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def is_type(value: Any, name: str) -> bool:
    """Whether `value` is of JSON Schema type `name`."""
    match name:
        case "null":
            return value is None
        case "boolean":
            return isinstance(value, bool)
        case "integer":
            return not isinstance(value, bool) and (
                isinstance(value, int) or (isinstance(value, float) and value.is_integer())
            )
        case "number":
            return not isinstance(value, bool) and isinstance(value, int | float)
        case "string":
            return isinstance(value, str)
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
    raise SchemaUnsupported(f"unknown type {name!r}")


def is_multiple(value: float, of: float) -> bool:
    """`multipleOf` as the jsonschema library checks it."""
    if isinstance(of, float):
        quotient = value / of
        return math.isfinite(quotient) and int(quotient) == quotient
    if isinstance(value, float):
        return value.is_integer() and int(value) % of == 0
    return value % of == 0


class Validator:
    """Checks instances against one root schema."""

    def __init__(self, root: Any) -> None:
        self.root = root

    def valid(self, schema: Any, value: Any) -> bool:
        """Whether `value` is valid under `schema` (a subschema of the root)."""
        if schema is True:
            return True
        if schema is False:
            return False
        if not isinstance(schema, Mapping):
            raise SchemaUnsupported("a schema must be an object or a boolean")
        if "$ref" in schema and not self.valid(deref(self.root, schema["$ref"]), value):
            return False
        return (
            self._generic(schema, value)
            and self._numeric(schema, value)
            and self._string(schema, value)
            and self._array(schema, value)
            and self._object(schema, value)
        )

    def _generic(self, s: Mapping[str, Any], v: Any) -> bool:
        types = s.get("type")
        if types is not None:
            names = [types] if isinstance(types, str) else types
            if not any(is_type(v, t) for t in names):
                return False
        if "const" in s and not json_equal(s["const"], v):
            return False
        if "enum" in s and not any(json_equal(e, v) for e in s["enum"]):
            return False
        if not all(self.valid(sub, v) for sub in s.get("allOf", ())):
            return False
        if "anyOf" in s and not any(self.valid(sub, v) for sub in s["anyOf"]):
            return False
        if "oneOf" in s and sum(self.valid(sub, v) for sub in s["oneOf"]) != 1:
            return False
        return not ("not" in s and self.valid(s["not"], v))

    def _numeric(self, s: Mapping[str, Any], v: Any) -> bool:
        if not is_type(v, "number"):
            return True
        lo, hi = s.get("minimum"), s.get("maximum")
        ex_lo, ex_hi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        # Draft 4 spells exclusivity as booleans beside minimum/maximum.
        if ex_lo is True:
            ex_lo, lo = lo, None
        if ex_hi is True:
            ex_hi, hi = hi, None
        checks = (
            lo is None or v >= lo,
            hi is None or v <= hi,
            ex_lo is None or ex_lo is False or v > ex_lo,
            ex_hi is None or ex_hi is False or v < ex_hi,
            "multipleOf" not in s or is_multiple(v, s["multipleOf"]),
        )
        return all(checks)

    def _string(self, s: Mapping[str, Any], v: Any) -> bool:
        if not isinstance(v, str):
            return True
        if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", math.inf):
            return False
        return "pattern" not in s or search_regex(s["pattern"]).search(v) is not None

    def _array(self, s: Mapping[str, Any], v: Any) -> bool:
        if not isinstance(v, list):
            return True
        if not s.get("minItems", 0) <= len(v) <= s.get("maxItems", math.inf):
            return False
        prefix, rest = item_schemas(s)
        for i, item in enumerate(v):
            if not self.valid(prefix[i] if i < len(prefix) else rest, item):
                return False
        if s.get("uniqueItems") and any(json_equal(a, b) for i, a in enumerate(v) for b in v[i + 1 :]):
            return False
        if "contains" in s:
            n = sum(self.valid(s["contains"], item) for item in v)
            if not s.get("minContains", 1) <= n <= s.get("maxContains", math.inf):
                return False
        return True

    def _object(self, s: Mapping[str, Any], v: Any) -> bool:
        if not isinstance(v, dict):
            return True
        if not s.get("minProperties", 0) <= len(v) <= s.get("maxProperties", math.inf):
            return False
        if any(k not in v for k in s.get("required", ())):
            return False
        for key, needs in dependent_required(s).items():
            if key in v and any(k not in v for k in needs):
                return False
        props = s.get("properties", {})
        patterns = s.get("patternProperties", {})
        names = s.get("propertyNames")
        known = self._known_properties(s) if "unevaluatedProperties" in s else set()
        for key, item in v.items():
            if names is not None and not self.valid(names, key):
                return False
            matched = key in props
            if matched and not self.valid(props[key], item):
                return False
            for pattern, sub in patterns.items():
                if search_regex(pattern).search(key) is not None:
                    matched = True
                    if not self.valid(sub, item):
                        return False
            if matched:
                continue
            if "additionalProperties" in s:
                if not self.valid(s["additionalProperties"], item):
                    return False
            elif "unevaluatedProperties" in s and key not in known:
                if not self.valid(s["unevaluatedProperties"], item):
                    return False
        return True

    def _known_properties(self, s: Mapping[str, Any]) -> set[str]:
        """Property names declared by `s` and the subschemas it applies in place (approximates
        unevaluatedProperties conservatively)."""
        known = set(s.get("properties", {}))
        subs = [*s.get("allOf", ()), *s.get("anyOf", ()), *s.get("oneOf", ())]
        if "$ref" in s:
            subs.append(deref(self.root, s["$ref"]))
        for sub in subs:
            if isinstance(sub, Mapping):
                known |= self._known_properties(sub)
        return known


def item_schemas(s: Mapping[str, Any]) -> tuple[list[Any], Any]:
    """An array schema's per-position schemas and the schema of every item after them."""
    if "prefixItems" in s:
        return list(s["prefixItems"]), s.get("items", s.get("unevaluatedItems", True))
    items = s.get("items", True)
    if isinstance(items, list):  # draft 4-2019: a tuple
        return items, s.get("additionalItems", s.get("unevaluatedItems", True))
    return [], items


def additional_schema(s: Mapping[str, Any]) -> Any:
    """The schema of properties an object schema does not declare."""
    return s.get("additionalProperties", s.get("unevaluatedProperties", True))


def dependent_required(s: Mapping[str, Any]) -> dict[str, list[str]]:
    """`dependentRequired`, and the list form of draft 4's `dependencies`."""
    out = {k: list(v) for k, v in s.get("dependentRequired", {}).items()}
    for key, dep in s.get("dependencies", {}).items():
        if not isinstance(dep, list):
            raise SchemaUnsupported("dependencies with a schema (not a list of names) are not supported")
        out.setdefault(key, []).extend(dep)
    return out
