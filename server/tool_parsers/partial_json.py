"""Where the parts of a JSON text that is still arriving are: enough to stream tool calls as they grow.

A JSON text only ever grows at its end, so the raw text of a value is final as soon as it appears: a
call's arguments can be streamed as they arrive, without re-encoding them (which would change earlier
pieces, e.g. when a number gets another digit). These functions find where values start and end; they
never build the values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"


class NotJSON(ValueError):
    """The text cannot be the beginning of the JSON expected here."""


def skip_ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after `i` (len(text) if none)."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index just past the string whose opening quote is at `i`; None if it has not closed yet."""
    j = i + 1
    n = len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at `i` (no leading whitespace); None if it is incomplete.

    A number or literal that reaches the end of the text counts as incomplete: more digits may follow.
    Raises NotJSON when the text cannot be a JSON value.
    """
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while j < n:
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if c in "-0123456789tfn":
        j = i
        while j < n and text[j] not in _WS and text[j] not in ",]};":
            j += 1
        if j == n:
            return None
        return j
    raise NotJSON(f"no JSON value starts with {c!r}")


@dataclass
class Member:
    """One member of a JSON object: its key, and where its value starts and (once complete) ends."""

    key: str
    start: int
    end: int | None


@dataclass
class ObjectScan:
    """The members of an object found so far; `end` is set once the object has closed."""

    members: list[Member]
    end: int | None

    def get(self, key: str) -> Member | None:
        """The first member named `key`."""
        return next((m for m in self.members if m.key == key), None)


def _key(text: str, i: int, end: int) -> str:
    try:
        key = json.loads(text[i:end])
    except ValueError as exc:
        raise NotJSON(f"bad object key {text[i:end]!r}") from exc
    return str(key)


def scan_object(text: str, i: int) -> ObjectScan:
    """The members of the object whose `{` is at `i`, as far as the text goes. Raises NotJSON."""
    if i >= len(text) or text[i] != "{":
        raise NotJSON("expected an object")
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    n = len(text)
    if j < n and text[j] == "}":
        return ObjectScan(members, j + 1)
    while j < n:
        if text[j] != '"':
            raise NotJSON("expected an object key")
        kend = string_end(text, j)
        if kend is None:
            return ObjectScan(members, None)
        key = _key(text, j, kend)
        j = skip_ws(text, kend)
        if j >= n:
            return ObjectScan(members, None)
        if text[j] != ":":
            raise NotJSON("expected ':' after an object key")
        j = skip_ws(text, j + 1)
        if j >= n:
            return ObjectScan(members, None)
        vend = value_end(text, j)
        members.append(Member(key, j, vend))
        if vend is None:
            return ObjectScan(members, None)
        j = skip_ws(text, vend)
        if j >= n:
            return ObjectScan(members, None)
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        if text[j] != ",":
            raise NotJSON("expected ',' or '}' in an object")
        j = skip_ws(text, j + 1)
    return ObjectScan(members, None)


def member_text(text: str, member: Member | None) -> str | None:
    """The raw text of a member's value so far (all of it once complete); None without the member."""
    if member is None:
        return None
    return text[member.start : member.end if member.end is not None else len(text)]


def member_string(text: str, member: Member | None) -> str | None:
    """A member's value once it is a complete JSON string; None before (a name is sent whole)."""
    if member is None or member.end is None or text[member.start] != '"':
        return None
    value = json.loads(text[member.start : member.end])
    return value if isinstance(value, str) else None
