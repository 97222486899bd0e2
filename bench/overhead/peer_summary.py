"""Medians over the alternating rounds of `bench.overhead --peer`: one system's rounds against the other's.

On a shared 2-core VM the same code's tokens/s moves by ±20 % between fresh stacks, so one A/B/A run cannot
separate a 10 % difference; `--rounds N` alternates the systems N times and this summarises each level by
the median of each system's rounds and by the ratio of every round of ours to the peer round beside it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def adjacent_pairs(systems: list[str]) -> list[tuple[int, int]]:
    """(our round, peer round) index pairs: every round of ours with the peer round right after it, else before."""
    pairs = []
    for i, name in enumerate(systems):
        if name != "ferry":
            continue
        j = i + 1 if i + 1 < len(systems) and systems[i + 1] != "ferry" else i - 1
        if 0 <= j < len(systems) and systems[j] != "ferry":
            pairs.append((i, j))
    return pairs


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def level_summary(runs: list[dict[str, Any]], level: int) -> dict[str, Any]:
    """Medians of each system's rounds at one level, the ratio of the medians and the pairwise ratios."""
    systems = [r["system"] for r in runs]
    peer_name = next(s for s in systems if s != "ferry")
    by_system: dict[str, dict[str, Any]] = {}
    for name in ("ferry", peer_name):
        levels = [r["levels"][level] for r in runs if r["system"] == name]
        by_system[name] = {
            "rounds": len(levels),
            "tokens_per_s": _median([p["tokens_per_s"] for p in levels]),
            "ttft_p50_ms": _median([p["ttft_ms"]["p50"] for p in levels]),
            "ttft_p99_ms": _median([p["ttft_ms"]["p99"] for p in levels]),
            "cpu_s_per_1k_tokens": _median([p["cpu_s_per_1k_tokens"]["system_total"] for p in levels]),
        }
    ours, theirs = by_system["ferry"], by_system[peer_name]
    pair_ratios: list[float] = []
    for i, j in adjacent_pairs(systems):
        a, b = runs[i]["levels"][level]["tokens_per_s"], runs[j]["levels"][level]["tokens_per_s"]
        if b:
            pair_ratios.append(round(a / b, 3))
    return {
        "concurrency": runs[0]["levels"][level]["concurrency"],
        "peer": peer_name,
        "ferry": ours,
        "other": theirs,
        "tokens_per_s_ratio_of_medians": (
            round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3) if theirs["tokens_per_s"] else None
        ),
        "tokens_per_s_pair_ratios": pair_ratios,
        "tokens_per_s_pair_ratio_median": _median(pair_ratios),
    }


def summary(runs: list[dict[str, Any]], levels: int) -> list[dict[str, Any]]:
    """`level_summary` of every level."""
    return [level_summary(runs, i) for i in range(levels)]
