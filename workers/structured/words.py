"""Short, word-shaped strings for generated outputs, so simulated text has realistic lengths and tokens."""

from __future__ import annotations

import random

# Common English words of 2-9 letters: strings built from them tokenize like real text.
WORDS: tuple[str, ...] = tuple(
    """
    able about account action active address after again agent air alpha amount answer apple area
    around art ask back bank base basic bear bed begin best bird black blue board boat body book
    border bottle box brain bread bridge bright bring brown build busy cake call calm camera card
    care carry case cat center chair change cheap check city claim class clean clear clock close
    cloud coast code coffee cold color common cook copy corner count country cover craft cream
    cross data date day deal deep delta desk detail direct door draft dream drive early earth east
    easy edge energy engine entry event exact face fact fair farm fast field file final fire first
    fish flag flat floor flow focus food forest form frame free fresh friend front fruit game
    garden gate gift glass gold good grain graph green group guide hand happy harbor heart heavy
    help high hill home honey hope horse hotel house idea image index input iron island item
    join journey key kind king lake lamp land large late layer leaf level light limit line link
    list local long loop lucky machine main map market match meadow metal middle model moment
    money month moon morning motor mountain music name nature network night noble north note
    number ocean offer office open orange order origin output owner page paint paper park part
    party path peace pencil people piano picture place plain plan plant point policy port power
    press price print quick quiet radio rain range rapid reason record red report river road rock
    room root round route rule safe sample scale school score sea season second signal silver
    simple single sky small smart snow solar sound south space speed spring square stable star
    state station stone story street strong summer sun system table task team test text theory
    thing time title today token tool top tower track trade train travel tree true union unit
    valley value vector village voice wall warm water wave west wheel white wind window winter
    wood word work world yellow young zone
    """.split()
)

# Length of an unconstrained phrase at most: short strings keep load-test outputs realistic.
_DEFAULT_MAX = 24


def word(rng: random.Random) -> str:
    """One word."""
    return rng.choice(WORDS)


def phrase(rng: random.Random, min_len: int = 0, max_len: int | None = None) -> str:
    """1-3 words joined by spaces, grown or cut to a length in [min_len, max_len] (min_len <= max_len)."""
    hi = max_len if max_len is not None else max(min_len, _DEFAULT_MAX)
    if hi <= 0:
        return ""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    while len(text) < min_len:
        text += " " + rng.choice(WORDS)
    if len(text) > hi:
        # Cut at the last word boundary that keeps the minimum, else inside a word.
        cut = text.rfind(" ", 0, hi + 1)
        text = text[:cut] if cut >= max(min_len, 1) else text[:hi]
    return text
