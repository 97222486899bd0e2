"""Strings for regexes: every supported construct matches in full, outputs read like text, the rest is refused."""

from __future__ import annotations

import random
import re

import pytest

from workers.structured.regex_gen import RegexUnsupported, check_pattern, regex_string

MATCHING = [
    r"\d{3}-\d{4}",
    r"^[a-z]+@[a-z]+\.(com|org|net)$",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]+)?",
    r'[^"\\]*',
    r"\w+",
    r"\W\S\s\D",
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    r"(?P<word>ab)+c?",
    r"(?<word>ab)+c?",
    r".{5}",
    r"[\u4e00-\u9fff]{2,3}",
    r"a{,3}b",
    r"x{2,}y*?z+?",
    r"\\d\.\*\(\)",
    r"[]a]+",
    r"[^]a]",
    r"[a-]+[-z]",
    r"[\d\s.,]{4}",
    r"(?:\+|-)?\d+(\.\d+)?([eE][+-]?\d+)?",
    r"\x41\u00e9\t\n",
    r"((a|b)(c|d)){2}",
    r"[a-zA-Z_][a-zA-Z0-9_]*",
    r"(true|false|null)",
    r"\{\}|\[\]",
    r"a{3}{",
    r"",
    r"^$",
    r"a|",
    r"(|x)y",
    r"[^\x00-\x7f]",
]


@pytest.mark.parametrize("pattern", MATCHING)
def test_generated_strings_match_in_full(pattern: str) -> None:
    python = re.compile(pattern.replace("(?<word>", "(?P<word>"))
    for seed in range(40):
        text = regex_string(pattern, random.Random(seed))
        assert python.fullmatch(text), (pattern, text)


def test_deterministic_per_seed_and_varied_across_seeds() -> None:
    pattern = r"[A-Z][a-z]+ \d{2}"
    assert regex_string(pattern, random.Random(5)) == regex_string(pattern, random.Random(5))
    assert len({regex_string(pattern, random.Random(s)) for s in range(40)}) > 20


def test_repeated_letter_classes_become_words() -> None:
    words = [regex_string(r"[a-z]+", random.Random(s)) for s in range(50)]
    from workers.structured.words import WORDS

    assert sum(w in WORDS for w in words) >= 30
    capitalised = [regex_string(r"[A-Z][a-z]{3,}", random.Random(s)) for s in range(20)]
    assert all(w[0].isupper() for w in capitalised)


def test_unbounded_repeats_stay_short() -> None:
    assert all(len(regex_string(r"(ab)*c+\d*", random.Random(s))) <= 2 * 3 + 4 + 3 for s in range(50))


def test_length_bounds_are_honoured_or_refused() -> None:
    for seed in range(20):
        text = regex_string(r"[a-z]{1,20}", random.Random(seed), min_len=5, max_len=6)
        assert 5 <= len(text) <= 6
    with pytest.raises(RegexUnsupported, match="no string of length"):
        regex_string(r"[a-z]{1,3}", random.Random(0), min_len=10)


REFUSED = {
    r"(a)\1": "escape \\1",
    r"(?=a)a": "group construct",
    r"(?<!a)b": "group construct",
    r"\bfoo\b": "escape \\b",
    r"(?i)abc": "group construct",
    r"a^b": "anchor",
    r"a$b": "anchor",
    r"[[:alpha:]]": "POSIX",
    r"\p{L}": "valid regular expression",
    r"a**": "valid regular expression",
    r"(ab": "valid regular expression",
    r"a)": "valid regular expression",
    r"[z-a]": "valid regular expression",
    r"a{5000}": "repeat",
    r"\A\d": "escape \\A",
}


@pytest.mark.parametrize("pattern", list(REFUSED))
def test_outside_the_subset_is_refused(pattern: str) -> None:
    with pytest.raises(RegexUnsupported) as info:
        check_pattern(pattern)
    assert REFUSED[pattern] in str(info.value)
