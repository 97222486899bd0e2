"""Numbers and formatted strings for JSON Schema instances: in bounds, and plausible."""

from __future__ import annotations

import math
import random
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from workers.structured.json_check import SchemaUnsupported, is_multiple
from workers.structured.words import word

# Whether a candidate value satisfies the whole schema it is drawn for.
Valid = Callable[[Any], bool]


def integer(s: Mapping[str, Any], rng: random.Random, valid: Valid) -> int:
    """An integer within the bounds and multipleOf of `s`, near 0..100 when they allow."""
    lo, hi = _bounds(s)
    lo_i = -math.inf if lo is None else (math.floor(lo[0]) + 1 if lo[1] else math.ceil(lo[0]))
    hi_i = math.inf if hi is None else (math.ceil(hi[0]) - 1 if hi[1] else math.floor(hi[0]))
    if lo_i > hi_i:
        raise SchemaUnsupported("no integer lies within minimum and maximum")
    step = s.get("multipleOf")
    if step is not None:
        return int(_multiple(step, lo_i, hi_i, True, rng, valid))
    return int(_near(lo_i, hi_i, 0, 100, rng))


def number(s: Mapping[str, Any], rng: random.Random, valid: Valid) -> float | int:
    """A number within the bounds and multipleOf of `s`, with two decimals where they allow."""
    lo, hi = _bounds(s)
    step = s.get("multipleOf")
    lo_v = -math.inf if lo is None else lo[0]
    hi_v = math.inf if hi is None else hi[0]
    if step is not None:
        return _multiple(step, lo_v, hi_v, False, rng, valid)
    exclusive = (lo is not None and lo[1]) or (hi is not None and hi[1])
    if lo_v > hi_v or (lo_v == hi_v and exclusive):
        raise SchemaUnsupported("no number lies within minimum and maximum")
    base = _near(lo_v, hi_v, 0.0, 100.0, rng)
    for value in (round(base, 2), round(base, 4), base, (lo_v + hi_v) / 2):
        if math.isfinite(value) and valid(value):
            return value
    raise SchemaUnsupported("no number lies within minimum and maximum")


def _near(lo: float, hi: float, default_lo: float, default_hi: float, rng: random.Random) -> float:
    """A value in [lo, hi], drawn from [default_lo, default_hi] moved into range."""
    width = default_hi - default_lo
    a = lo if math.isfinite(lo) else (min(default_lo, hi - width) if math.isfinite(hi) else default_lo)
    b = hi if math.isfinite(hi) else a + width
    b = min(b, a + width) if math.isfinite(lo) else b
    if isinstance(default_lo, int):
        return rng.randint(int(a), int(b))
    return rng.uniform(a, b)


def _multiple(
    step: float, lo: float, hi: float, whole: bool, rng: random.Random, valid: Valid
) -> int | float:
    if step <= 0:
        raise SchemaUnsupported("multipleOf must be positive")
    if math.isfinite(lo):
        first = math.ceil(lo / step)
    else:
        first = 0 if not math.isfinite(hi) or hi >= 0 else math.floor(hi / step) - 20
    start = first + rng.randint(0, 20)
    for k in [*range(start, start + 200), *range(first, start)]:
        value: int | float = k * step
        if isinstance(value, float) and value.is_integer() and (whole or isinstance(step, int)):
            value = int(value)
        elif whole and isinstance(value, float):
            continue
        # Checked as the jsonschema library checks it: 0.07 is no multiple of 0.01 in floats.
        if is_multiple(value, step) and valid(value):
            return value
    raise SchemaUnsupported("no multiple of multipleOf lies within minimum and maximum")


def _bounds(s: Mapping[str, Any]) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """(lower, exclusive) and (upper, exclusive), tightest of the inclusive and exclusive forms."""
    lo: tuple[float, bool] | None = None
    hi: tuple[float, bool] | None = None
    ex_lo, ex_hi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if "minimum" in s:
        lo = (s["minimum"], ex_lo is True)
    if "maximum" in s:
        hi = (s["maximum"], ex_hi is True)
    if isinstance(ex_lo, int | float) and not isinstance(ex_lo, bool) and (lo is None or ex_lo >= lo[0]):
        lo = (ex_lo, True)
    if isinstance(ex_hi, int | float) and not isinstance(ex_hi, bool) and (hi is None or ex_hi <= hi[0]):
        hi = (ex_hi, True)
    return lo, hi


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2000, 2030):04d}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


# Plausible values of the formats clients use; other formats get an ordinary phrase.
FORMATS: dict[str, Callable[[random.Random], str]] = {
    "date": _date,
    "time": _time,
    "date-time": lambda r: f"{_date(r)}T{_time(r)}",
    "duration": lambda r: f"P{r.randint(1, 30)}D",
    "email": lambda r: f"{word(r)}.{word(r)}@example.com",
    "idn-email": lambda r: f"{word(r)}@example.com",
    "hostname": lambda r: f"{word(r)}.example.com",
    "idn-hostname": lambda r: f"{word(r)}.example.com",
    "ipv4": lambda r: f"192.0.2.{r.randint(1, 254)}",
    "ipv6": lambda r: f"2001:db8::{r.randint(1, 0xFFFF):x}",
    "uri": lambda r: f"https://example.com/{word(r)}",
    "url": lambda r: f"https://example.com/{word(r)}",
    "iri": lambda r: f"https://example.com/{word(r)}",
    "uri-reference": lambda r: f"/{word(r)}/{word(r)}",
    "iri-reference": lambda r: f"/{word(r)}/{word(r)}",
    "uri-template": lambda r: f"https://example.com/{word(r)}/{{id}}",
    "json-pointer": lambda r: f"/{word(r)}/0",
    "relative-json-pointer": lambda r: f"0/{word(r)}",
    "uuid": _uuid,
    "regex": lambda r: f"^{word(r)}$",
}
