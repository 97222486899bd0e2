"""Strings that fully match a regular expression, for a practical subset of regex syntax.

Supported: literals and escapes, `.`, classes (`[a-z_]`, `[^"]`, `\\d \\w \\s` and their negations),
groups (capturing, `(?:...)`, named), alternation, the quantifiers `* + ? {n} {n,} {n,m} {,m}` (lazy or
possessive too), and `^`/`$` at the ends of the pattern. Everything else (backreferences, lookaround,
word boundaries, inline flags, Unicode properties) is refused with RegexUnsupported, and so is any
string Python's `re` does not confirm as a full match, so a returned string always matches.
"""

from __future__ import annotations

import functools
import random
import re
import warnings
from dataclasses import dataclass

from workers.structured.words import WORDS

# Repeats stop this many items past their minimum at most, unless a length bound asks for more.
_EXTRA_REPEATS = 3
_MAX_REPEAT = 4096
_MAX_CODEPOINT = 0x10FFFF
_PRINTABLE = (0x20, 0x7E)


class RegexUnsupported(ValueError):
    """The pattern is outside the supported subset, or not a valid regular expression."""


@dataclass(frozen=True, slots=True)
class _Chars:
    """A set of characters as sorted, disjoint, inclusive code-point ranges."""

    ranges: tuple[tuple[int, int], ...]

    def __contains__(self, c: str) -> bool:
        o = ord(c)
        return any(lo <= o <= hi for lo, hi in self.ranges)


@dataclass(frozen=True, slots=True)
class _Seq:
    items: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Alt:
    options: tuple[_Node, ...]


@dataclass(frozen=True, slots=True)
class _Repeat:
    node: _Node
    lo: int
    hi: int | None


_Node = _Chars | _Seq | _Alt | _Repeat


def _normalise(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _complement(chars: _Chars) -> _Chars:
    out: list[tuple[int, int]] = []
    start = 0
    for lo, hi in chars.ranges:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= _MAX_CODEPOINT:
        out.append((start, _MAX_CODEPOINT))
    return _Chars(tuple(out))


def _one(c: str) -> _Chars:
    return _Chars(((ord(c), ord(c)),))


_DIGIT = _Chars(((0x30, 0x39),))
_WORD = _Chars(_normalise([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]))
_SPACE = _Chars(_normalise([(0x09, 0x0D), (0x20, 0x20)]))
_CLASS_ESCAPES = {
    "d": _DIGIT,
    "D": _complement(_DIGIT),
    "w": _WORD,
    "W": _complement(_WORD),
    "s": _SPACE,
    "S": _complement(_SPACE),
}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_DOT = _complement(_one("\n"))
_QUANTIFIER = re.compile(r"\{(\d*)(?:(,)(\d*))?\}")


class _Parser:
    """Recursive descent over one pattern."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.depth = 0

    def fail(self, what: str) -> RegexUnsupported:
        return RegexUnsupported(f"{what} (at offset {self.i} of the pattern) is not supported")

    def parse(self) -> _Node:
        node = self.alternation()
        if self.i != len(self.p):
            raise RegexUnsupported(f"unbalanced ')' at offset {self.i} of the pattern")
        return node

    def alternation(self) -> _Node:
        options = [self.sequence()]
        while self.i < len(self.p) and self.p[self.i] == "|":
            self.i += 1
            options.append(self.sequence())
        return options[0] if len(options) == 1 else _Alt(tuple(options))

    def sequence(self) -> _Node:
        items: list[_Node] = []
        while self.i < len(self.p) and self.p[self.i] not in "|)":
            c = self.p[self.i]
            if c == "^" and self.depth == 0 and not items:
                self.i += 1
                continue
            if c == "$" and self.depth == 0 and (self.i + 1 == len(self.p) or self.p[self.i + 1] == "|"):
                self.i += 1
                continue
            if c in "^$":
                raise self.fail(f"an anchor {c!r} inside the pattern")
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else _Seq(tuple(items))

    def quantified(self, node: _Node) -> _Node:
        if self.i >= len(self.p):
            return node
        c = self.p[self.i]
        lo: int
        hi: int | None
        if c in "*+?":
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            self.i += 1
        elif c == "{" and (m := _QUANTIFIER.match(self.p, self.i)) and (m[1] or m[3]):
            lo = int(m[1] or 0)
            hi = None if m[2] and not m[3] else int(m[3] or m[1])
            if max(lo, hi or 0) > _MAX_REPEAT or (hi is not None and hi < lo):
                raise self.fail(f"the repeat {m[0]}")
            self.i = m.end()
        else:
            return node
        if self.i < len(self.p) and self.p[self.i] in "?+":
            self.i += 1  # lazy or possessive: the same strings match
        if self.i < len(self.p) and self.p[self.i] in "*+?{" and self._starts_quantifier():
            raise self.fail("a quantifier after a quantifier")
        return _Repeat(node, lo, hi)

    def _starts_quantifier(self) -> bool:
        if self.p[self.i] != "{":
            return True
        m = _QUANTIFIER.match(self.p, self.i)
        return m is not None and bool(m[1] or m[3])

    def atom(self) -> _Node:
        c = self.p[self.i]
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return _DOT
        if c == "\\":
            return self.escape(in_class=False)
        if c in "*+?" or (c == "{" and self._starts_quantifier()):
            raise self.fail("a quantifier with nothing to repeat")
        self.i += 1
        return _one(c)

    def group(self) -> _Node:
        self.i += 1
        rest = self.p[self.i :]
        if rest.startswith("?"):
            named = re.match(r"\?P?<([A-Za-z_]\w*)>", rest)
            if rest.startswith("?:"):
                self.i += 2
            elif named:
                self.i += named.end()
            else:
                raise self.fail("the group construct '(" + rest[:3] + "'")
        self.depth += 1
        node = self.alternation()
        self.depth -= 1
        if self.i >= len(self.p) or self.p[self.i] != ")":
            raise RegexUnsupported("missing ')' in the pattern")
        self.i += 1
        return node

    def escape(self, in_class: bool) -> _Chars:
        if self.i + 1 >= len(self.p):
            raise RegexUnsupported("the pattern ends with a lone backslash")
        c = self.p[self.i + 1]
        self.i += 2
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return _one(_CHAR_ESCAPES[c])
        if c in "xu":
            digits = 2 if c == "x" else 4
            code = self.p[self.i : self.i + digits]
            if len(code) != digits or not all(d in "0123456789abcdefABCDEF" for d in code):
                raise self.fail(f"the escape \\{c}{code}")
            self.i += digits
            return _one(chr(int(code, 16)))
        if c == "b" and in_class:
            return _one("\b")
        if c.isalnum():
            raise self.fail(f"the escape \\{c}")
        return _one(c)

    def char_class(self) -> _Chars:
        self.i += 1
        negated = self.i < len(self.p) and self.p[self.i] == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            if self.i >= len(self.p):
                raise RegexUnsupported("missing ']' in the pattern")
            c = self.p[self.i]
            if c == "]" and not first:
                self.i += 1
                break
            if self.p.startswith("[:", self.i):
                raise self.fail("a POSIX class")
            first = False
            item = self.escape(in_class=True) if c == "\\" else self._class_char()
            single = len(item.ranges) == 1 and item.ranges[0][0] == item.ranges[0][1]
            if single and self.p.startswith("-", self.i) and not self.p.startswith("-]", self.i):
                self.i += 1
                end = self.escape(in_class=True) if self.p[self.i] == "\\" else self._class_char()
                if (
                    len(end.ranges) != 1
                    or end.ranges[0][0] != end.ranges[0][1]
                    or end.ranges[0][0] < item.ranges[0][0]
                ):
                    raise self.fail("a bad range in a class")
                ranges.append((item.ranges[0][0], end.ranges[0][0]))
            else:
                ranges.extend(item.ranges)
        chars = _Chars(_normalise(ranges))
        return _complement(chars) if negated else chars

    def _class_char(self) -> _Chars:
        c = self.p[self.i]
        self.i += 1
        return _one(c)


@functools.lru_cache(maxsize=512)
def _parse(pattern: str) -> _Node:
    return _Parser(pattern).parse()


@functools.lru_cache(maxsize=512)
def python_regex(pattern: str) -> re.Pattern[str]:
    """`pattern` compiled by Python's `re`, with ECMA-style named groups `(?<name>...)` spelled Python's way."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "possible nested set": we refuse those anyway
            return re.compile(re.sub(r"\(\?<(?=[A-Za-z_])", "(?P<", pattern))
    except re.error as e:
        raise RegexUnsupported(f"not a valid regular expression: {e}") from e


def check_pattern(pattern: str) -> None:
    """Raise RegexUnsupported unless strings can be generated for `pattern`."""
    python_regex(pattern)
    _parse(pattern)


def regex_string(pattern: str, rng: random.Random, min_len: int = 0, max_len: int | None = None) -> str:
    """A string that fully matches `pattern`, with a length in [min_len, max_len] where one was found."""
    regex = python_regex(pattern)
    node = _parse(pattern)
    extra = _EXTRA_REPEATS
    for _ in range(16):
        text = "".join(_generate(node, rng, extra))
        if regex.fullmatch(text) is None:
            raise RegexUnsupported("the pattern uses regex features the simulated engine cannot honour")
        if len(text) < min_len:
            extra = max(2 * extra, min_len)  # let repeats run longer
        elif max_len is not None and len(text) > max_len:
            extra //= 2
        else:
            return text
    raise RegexUnsupported(f"no string of length {min_len}..{max_len} found for the pattern")


def _generate(node: _Node, rng: random.Random, extra: int) -> list[str]:
    """Pieces of one matching string; a repeat runs at most `extra` items past its minimum."""
    match node:
        case _Chars():
            return [_pick_char(node, rng)]
        case _Seq(items):
            return [piece for item in items for piece in _generate(item, rng, extra)]
        case _Alt(options):
            return _generate(rng.choice(options), rng, extra)
        case _Repeat(inner, lo, hi):
            top = lo + extra if hi is None else min(hi, lo + extra)
            if isinstance(inner, _Chars) and rng.random() < 0.8:
                # Letters in a repeated class: a real word reads better than noise.
                words = _words_in(inner, lo, top if hi is not None else lo + max(extra, 8))
                if words:
                    return [rng.choice(words)]
            n = rng.randint(lo, top)
            return [piece for _ in range(n) for piece in _generate(inner, rng, extra)]
    raise AssertionError(node)


# Characters tried first, in order of preference, so generated strings look like text.
_PREFERRED = [
    [chr(c) for c in range(ord("a"), ord("z") + 1)],
    [chr(c) for c in range(ord("A"), ord("Z") + 1)],
    [chr(c) for c in range(ord("0"), ord("9") + 1)],
    list(" -_.,"),
    [chr(c) for c in range(_PRINTABLE[0], _PRINTABLE[1] + 1)],
]


@functools.lru_cache(maxsize=1024)
def _words_in(chars: _Chars, lo: int, hi: int) -> tuple[str, ...]:
    """Words (or their capitalised or upper-case forms) of a length in [lo, hi] made of `chars` only."""
    found: list[str] = []
    for w in WORDS:
        if lo <= len(w) <= hi:
            form = next((f for f in (w, w.capitalize(), w.upper()) if all(c in chars for c in f)), None)
            if form is not None:
                found.append(form)
    return tuple(found)


@functools.lru_cache(maxsize=1024)
def _preferred_in(chars: _Chars) -> tuple[str, ...]:
    for group in _PREFERRED:
        allowed = tuple(c for c in group if c in chars)
        if allowed:
            return allowed
    return ()


def _pick_char(chars: _Chars, rng: random.Random) -> str:
    preferred = _preferred_in(chars)
    if preferred:
        return rng.choice(preferred)
    if not chars.ranges:
        raise RegexUnsupported("the pattern has a character class that matches nothing")
    lo, hi = rng.choice(chars.ranges)
    # Surrogates cannot be encoded; skip past them.
    c = rng.randint(lo, hi)
    if 0xD800 <= c <= 0xDFFF:
        c = 0xE000 if hi >= 0xE000 else lo
    return chr(c)
