"""JSON instances valid under a JSON Schema, chosen deterministically from a seed.

Covers what clients send: pydantic's `model_json_schema()` (`$defs`/`$ref`, `anyOf` for Optional and
unions, `enum`, `const`, `format`, `prefixItems`, recursion), OpenAI strict-mode schemas and tool-call
schemas. Strings are short phrases of real words, arrays hold 1-3 items and optional properties appear
about half the time, so outputs have realistic sizes. Every instance is checked with json_check before
it is returned; a schema this cannot honour raises SchemaUnsupported naming the reason.
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

from workers.structured.json_check import (
    REFUSED,
    SchemaUnsupported,
    Validator,
    additional_schema,
    dependent_required,
    deref,
    item_schemas,
    json_equal,
)
from workers.structured.regex_gen import RegexUnsupported, regex_string
from workers.structured.scalars import FORMATS, integer, number
from workers.structured.words import phrase, word

# Past this depth the generator takes the shortest way out: no optional properties, minimum items,
# null or non-recursive branches first. Past the hard limit a schema counts as endlessly recursive.
_SOFT_DEPTH = 5
_HARD_DEPTH = 40
# Bounds on one instance, so a hostile schema cannot make a worker build something huge.
_MAX_NODES = 5000
_MAX_LENGTH = 10_000
_TRIES = 8
_ANNOTATIONS = frozenset(
    (
        "title",
        "description",
        "default",
        "examples",
        "$comment",
        "$schema",
        "$id",
        "$anchor",
        "$defs",
        "definitions",
        "discriminator",
        "readOnly",
        "writeOnly",
        "deprecated",
        "contentEncoding",
        "contentMediaType",
        "contentSchema",
        "strict",
        "$ref",
    )
)
# What _unique_item answers when it found no value distinct from the items so far.
_NONE_LEFT = object()
_LOWER = ("minimum", "minLength", "minItems", "minProperties", "minContains")
_UPPER = ("maximum", "maxLength", "maxItems", "maxProperties", "maxContains")


def schema_instance(root: Any, rng: random.Random) -> Any:
    """An instance valid under the JSON Schema `root`; raises SchemaUnsupported if none can be made."""
    gen = _Generator(root, rng)
    value = gen.value(root, 0)
    if not gen.check.valid(root, value):
        raise SchemaUnsupported("the schema combines keywords in a way the simulated engine cannot honour")
    return value


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """One flat schema that accepts what both `a` and `b` accept (for allOf and $ref siblings)."""
    out = dict(a)
    for key, vb in b.items():
        if key not in out or key in _ANNOTATIONS:
            out.setdefault(key, vb)
            continue
        va = out[key]
        if key == "properties":
            out[key] = {k: {"allOf": [va[k], vb[k]]} if k in va else vb[k] for k in vb} | {
                k: v for k, v in va.items() if k not in vb
            }
        elif key == "allOf":  # oneOfs left over from earlier merges
            out[key] = [*va, *vb]
        elif key == "required":
            out[key] = list(dict.fromkeys([*va, *vb]))
        elif key == "type":
            out[key] = _intersect_types(va, vb)
        elif key == "enum":
            out[key] = [x for x in va if any(json_equal(x, y) for y in vb)]
        elif key in _LOWER or key in _UPPER:
            out[key] = max(va, vb) if key in _LOWER else min(va, vb)
        elif key in ("anyOf", "oneOf", "not", "additionalProperties", "items", "propertyNames", "contains"):
            if key == "anyOf":
                out[key] = [{"allOf": [x, y]} for x in va for y in vb]
            elif key == "not":
                out[key] = {"anyOf": [va, vb]}
            elif key == "oneOf":
                out["allOf"] = [*out.get("allOf", ()), {"oneOf": vb}]
            else:
                out[key] = False if va is False or vb is False else {"allOf": [va, vb]}
        elif not json_equal(va, vb):
            raise SchemaUnsupported(f"allOf (or $ref with siblings) combining two different {key!r}")
    return out


def _intersect_types(a: str | list[str], b: str | list[str]) -> list[str]:
    sa = {a} if isinstance(a, str) else set(a)
    sb = {b} if isinstance(b, str) else set(b)
    both = sa & sb
    if ("integer" in sa and "number" in sb) or ("number" in sa and "integer" in sb):
        both.add("integer")
    if not both:
        raise SchemaUnsupported(f"no value has both type {a!r} and type {b!r}")
    return sorted(both)


class _Generator:
    """Builds one instance; holds the root (for $ref), the random source and the size budget."""

    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.check = Validator(root)
        self.nodes = 0
        # Nesting of value() calls: branches that lead back to themselves do not deepen `depth`.
        self.active = 0

    # -- schemas ---------------------------------------------------------------------------

    def flatten(self, schema: Any, seen: frozenset[str] = frozenset()) -> dict[str, Any]:
        """`schema` with its $ref and allOf merged in; a second oneOf is kept aside in "allOf" (see merge)."""
        if schema is True:
            return {}
        if schema is False:
            raise SchemaUnsupported("the schema accepts nothing here (false)")
        if not isinstance(schema, Mapping):
            raise SchemaUnsupported("a schema must be an object or a boolean")
        for key in REFUSED:
            if key in schema:
                raise SchemaUnsupported(f"the keyword {key!r} is not supported")
        out: dict[str, Any] = {}
        ref = schema.get("$ref")
        if ref is not None:
            if ref in seen:
                raise SchemaUnsupported(f"$ref {ref!r} refers to itself without anything in between")
            out = self.flatten(deref(self.root, ref), seen | {ref})
        out = merge(out, {k: v for k, v in schema.items() if k not in ("$ref", "allOf")})
        for sub in schema.get("allOf", ()):
            out = merge(out, self.flatten(sub, seen))
        return out

    def value(self, schema: Any, depth: int) -> Any:
        """One instance of `schema`."""
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise SchemaUnsupported("the schema needs too large an instance")
        if depth > _HARD_DEPTH or self.active > 4 * _HARD_DEPTH:
            raise SchemaUnsupported("the schema recurses without a way to end")
        self.active += 1
        try:
            return self._value(schema, depth)
        finally:
            self.active -= 1

    def _value(self, schema: Any, depth: int) -> Any:
        s = self.flatten(schema)
        if "allOf" in s:  # oneOfs left by merge: pick a branch of each
            rest = {k: v for k, v in s.items() if k != "allOf"}
            for sub in s["allOf"]:
                rest = merge(rest, {"anyOf": sub["oneOf"]})
            s = rest
        if "const" in s:
            return self._pick_member(s, [s["const"]])
        if "enum" in s:
            return self._pick_member(s, list(s["enum"]))
        for key in ("oneOf", "anyOf"):
            if key in s:
                return self._branch(s, key, depth)
        if "not" in s:
            return self._avoiding(s, depth)
        return self._typed(s, depth)

    def _pick_member(self, s: dict[str, Any], members: list[Any]) -> Any:
        rest = {k: v for k, v in s.items() if k not in ("const", "enum")}
        order = members[:]
        self.rng.shuffle(order)
        for m in order:
            if self.check.valid(rest, m):
                return copy.deepcopy(m)
        raise SchemaUnsupported("no member of enum/const satisfies the rest of its schema")

    def _branch(self, s: dict[str, Any], key: str, depth: int) -> Any:
        base = {k: v for k, v in s.items() if k != key}
        branches = list(s[key])
        if not branches:
            raise SchemaUnsupported(f"an empty {key}")
        order = self._branch_order(branches, depth)
        last: SchemaUnsupported | None = None
        # A oneOf value may happen to match another branch too: draw again a few times.
        attempts = [b for b in order for _ in range(3 if key == "oneOf" else 1)]
        for branch in attempts:
            try:
                candidate = self.value(merge(base, self.flatten(branch)), depth)
            except SchemaUnsupported as e:
                last = e
                continue
            if key == "anyOf" or sum(self.check.valid(b, candidate) for b in branches) == 1:
                return candidate
        raise last or SchemaUnsupported(f"no value matches exactly one branch of {key}")

    def _branch_order(self, branches: list[Any], depth: int) -> list[Any]:
        order = branches[:]
        self.rng.shuffle(order)

        def is_null(b: Any) -> bool:
            return isinstance(b, Mapping) and b.get("type") == "null"

        if depth >= _SOFT_DEPTH:
            # The way out of a recursion: null first, then branches that do not refer elsewhere.
            order.sort(key=lambda b: (not is_null(b), isinstance(b, Mapping) and "$ref" in b))
        elif self.rng.random() < 0.8:
            # Optional values are mostly present, as in real outputs.
            order.sort(key=is_null)
        return order

    def _avoiding(self, s: dict[str, Any], depth: int) -> Any:
        rest = {k: v for k, v in s.items() if k != "not"}
        for _ in range(4 * _TRIES):
            candidate = self.value(rest, depth)
            if not self.check.valid(s["not"], candidate):
                return candidate
        raise SchemaUnsupported("no value found that avoids the schema under 'not'")

    # -- typed values ----------------------------------------------------------------------

    def _typed(self, s: dict[str, Any], depth: int) -> Any:
        types = s.get("type")
        if types is None:
            names = [_infer_type(s)]
        else:
            names = [types] if isinstance(types, str) else list(types)
        if not names:
            raise SchemaUnsupported("an empty type list")
        self.rng.shuffle(names)
        if "null" in names and len(names) > 1 and (depth < _SOFT_DEPTH and self.rng.random() < 0.8):
            names.remove("null")
            names.append("null")
        elif "null" in names and depth >= _SOFT_DEPTH:
            names.remove("null")
            names.insert(0, "null")
        makers: dict[str, Callable[[dict[str, Any], int], Any]] = {
            "object": self._object,
            "array": self._array,
            "string": lambda s, _d: self._string(s),
            "integer": lambda s, _d: integer(s, self.rng, functools.partial(self.check.valid, s)),
            "number": lambda s, _d: number(s, self.rng, functools.partial(self.check.valid, s)),
            "boolean": lambda _s, _d: self.rng.random() < 0.5,
            "null": lambda _s, _d: None,
            "any": lambda _s, _d: phrase(self.rng),
        }
        last: SchemaUnsupported | None = None
        for name in names:
            if name not in makers:
                raise SchemaUnsupported(f"unknown type {name!r}")
            try:
                return makers[name](s, depth)
            except SchemaUnsupported as e:
                last = e
        assert last is not None
        raise last

    def _object(self, s: dict[str, Any], depth: int) -> dict[str, Any]:
        props: Mapping[str, Any] = s.get("properties", {})
        required = list(dict.fromkeys(s.get("required", ())))
        deep = depth >= _SOFT_DEPTH
        keys = [k for k in props if k in required or (not deep and self.rng.random() < 0.5)]
        keys += [k for k in required if k not in props]
        min_p, max_p = s.get("minProperties", 0), s.get("maxProperties", math.inf)
        if len(required) > max_p:
            raise SchemaUnsupported("more required properties than maxProperties allows")
        while len(keys) > max_p:
            keys.remove(next(k for k in reversed(keys) if k not in required))
        needs = dependent_required(s)
        for key in list(keys):
            for dep in needs.get(key, ()):
                if dep not in keys:
                    keys.append(dep)
        for key in props:
            if len(keys) >= min_p:
                break
            if key not in keys:
                keys.append(key)
        free_form = not props and not s.get("patternProperties") and min_p == 0 and not deep
        if additional_schema(s) is not False or s.get("patternProperties"):
            wanted = max(min_p - len(keys), self.rng.randint(1, 3) if free_form else 0)
            keys += self._extra_keys(s, keys, wanted)
        if len(keys) < min_p:
            raise SchemaUnsupported("minProperties cannot be met without undeclared properties")
        return {key: self.value(self._property_schema(s, key), depth + 1) for key in keys}

    def _extra_keys(self, s: dict[str, Any], taken: list[str], n: int) -> list[str]:
        names = s.get("propertyNames")
        patterns = list(s.get("patternProperties", {}))
        keys: list[str] = []
        for _ in range(n * _TRIES):
            if len(keys) == n:
                break
            if names is not None:
                key = self.value(merge(self.flatten(names), {"type": "string"}), _HARD_DEPTH)
            elif patterns and additional_schema(s) is False:
                key = self._regex(self.rng.choice(patterns), 1, 32)
            else:
                key = word(self.rng)
            if key not in taken and key not in keys:
                keys.append(key)
        return keys

    def _property_schema(self, s: dict[str, Any], key: str) -> Any:
        parts: list[Any] = []
        props = s.get("properties", {})
        if key in props:
            parts.append(props[key])
        for pattern, sub in s.get("patternProperties", {}).items():
            if self.check.valid({"pattern": pattern}, key):
                parts.append(sub)
        if not parts:
            extra = additional_schema(s)
            if extra is False:
                raise SchemaUnsupported(f"property {key!r} is required but not allowed")
            parts.append(extra)
        return parts[0] if len(parts) == 1 else {"allOf": parts}

    def _array(self, s: dict[str, Any], depth: int) -> list[Any]:
        prefix, rest = item_schemas(s)
        lo = s.get("minItems", 0)
        hi = s.get("maxItems", math.inf)
        if rest is False:
            hi = min(hi, len(prefix))
        if lo > hi or lo > _MAX_NODES:
            raise SchemaUnsupported("minItems cannot be met")
        # 1-3 items near the top, fewer further down, so recursive schemas stay small.
        n = (
            lo
            if depth >= _SOFT_DEPTH
            else max(lo, 1) + (self.rng.choice((0, 0, 0, 1, 1, 2)) if depth < 2 else 0)
        )
        n = int(min(max(n, len(prefix) if hi >= len(prefix) else lo), hi))
        contains = s.get("contains")
        n_contains = s.get("minContains", 1) if contains is not None else 0
        if n_contains > n:
            n = n_contains
            if n > hi:
                raise SchemaUnsupported("minContains cannot be met within maxItems")
        items: list[Any] = []
        for i in range(n):
            item_schema = prefix[i] if i < len(prefix) else rest
            if i < n_contains:
                item_schema = {"allOf": [item_schema, contains]}
            item = self._unique_item(s, item_schema, items, depth)
            if item is _NONE_LEFT:
                if i < lo:
                    raise SchemaUnsupported("uniqueItems cannot be met")
                break  # the optional items ran out of distinct values
            items.append(item)
        return items

    def _unique_item(self, s: dict[str, Any], schema: Any, items: list[Any], depth: int) -> Any:
        for _ in range(4 * _TRIES if s.get("uniqueItems") else 1):
            item = self.value(schema, depth + 1)
            if not s.get("uniqueItems") or not any(json_equal(item, x) for x in items):
                return item
        return _NONE_LEFT

    def _string(self, s: dict[str, Any]) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if lo > _MAX_LENGTH or (hi is not None and lo > hi):
            raise SchemaUnsupported("minLength cannot be met")
        fmt = FORMATS.get(s.get("format", ""))
        pattern = s.get("pattern")
        for _ in range(_TRIES):
            if fmt is not None:
                text = fmt(self.rng)
            elif pattern is not None:
                text = self._regex(pattern, lo, hi)
            else:
                text = phrase(self.rng, lo, hi)
            if self.check.valid({k: s[k] for k in ("minLength", "maxLength", "pattern") if k in s}, text):
                return text
        raise SchemaUnsupported("no string satisfies its format, pattern and length together")

    def _regex(self, pattern: str, lo: int, hi: int | None) -> str:
        try:
            return regex_string(pattern, self.rng, lo, hi)
        except RegexUnsupported as e:
            raise SchemaUnsupported(f"pattern {pattern!r}: {e}") from e


def _infer_type(s: Mapping[str, Any]) -> str:
    """The type a schema without `type` most plausibly describes, from its keywords."""
    clues = {
        "object": (
            "properties",
            "required",
            "additionalProperties",
            "patternProperties",
            "minProperties",
            "maxProperties",
            "propertyNames",
            "dependentRequired",
            "unevaluatedProperties",
        ),
        "array": (
            "items",
            "prefixItems",
            "minItems",
            "maxItems",
            "contains",
            "uniqueItems",
            "unevaluatedItems",
        ),
        "string": ("minLength", "maxLength", "pattern", "format"),
        "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    }
    for name, keys in clues.items():
        if any(k in s for k in keys):
            return name
    return "any"
