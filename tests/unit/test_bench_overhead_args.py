"""bench.overhead's arguments and its side-by-side summary: the plot beside the JSON, alternating rounds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.overhead.__main__ import parse_args


def test_the_plot_goes_beside_the_results_file() -> None:
    assert parse_args([]).plot == Path("bench/results/overhead.png")
    assert parse_args(["--out", "/tmp/trial.json"]).plot == Path("/tmp/trial.png")
    assert parse_args(["--out", "/tmp/trial.json", "--plot", "/tmp/p.png"]).plot == Path("/tmp/p.png")
    assert str(parse_args(["--plot", ""]).plot) == "."  # '' = no plot, as before


def test_rounds_alternate_and_need_a_peer() -> None:
    from bench.overhead.peer import rounds

    args = parse_args(["--peer", "dynamo", "--rounds", "6"])
    assert [r.label for r in rounds(args)] == ["ferry", "dynamo"] * 3
    assert [r.label for r in rounds(parse_args(["--peer", "dynamo"]))] == ["ferry", "dynamo", "ferry"]
    for bad in (["--rounds", "5"], ["--peer", "dynamo", "--rounds", "1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def _level(tokens_per_s: float, ttft_p50: float, cpu: float) -> dict[str, Any]:
    return {
        "concurrency": 16,
        "tokens_per_s": tokens_per_s,
        "ttft_ms": {"p50": ttft_p50, "p99": 2 * ttft_p50},
        "cpu_s_per_1k_tokens": {"system_total": cpu},
    }


def test_the_summary_takes_medians_and_pairs_each_round_with_its_neighbour() -> None:
    from bench.overhead.peer_summary import adjacent_pairs, level_summary

    assert adjacent_pairs(["ferry", "dynamo", "ferry", "dynamo", "ferry"]) == [(0, 1), (2, 3), (4, 3)]
    assert adjacent_pairs(["ferry", "ferry (peer)"]) == [(0, 1)]
    ours = [30_000.0, 20_000.0, 26_000.0]
    theirs = [25_000.0, 20_000.0]
    runs = [
        {"system": "ferry", "levels": [_level(ours[0], 40, 0.06)]},
        {"system": "dynamo", "levels": [_level(theirs[0], 20, 0.05)]},
        {"system": "ferry", "levels": [_level(ours[1], 60, 0.08)]},
        {"system": "dynamo", "levels": [_level(theirs[1], 18, 0.05)]},
        {"system": "ferry", "levels": [_level(ours[2], 50, 0.07)]},
    ]
    s = level_summary(runs, 0)
    assert s["peer"] == "dynamo"
    assert s["ferry"]["tokens_per_s"] == 26_000 and s["other"]["tokens_per_s"] == 22_500
    assert s["ferry"]["ttft_p50_ms"] == 50 and s["other"]["ttft_p99_ms"] == 38
    assert s["ferry"]["cpu_s_per_1k_tokens"] == 0.07 and s["ferry"]["rounds"] == 3
    assert s["tokens_per_s_ratio_of_medians"] == round(26_000 / 22_500, 3)
    assert s["tokens_per_s_pair_ratios"] == [1.2, 1.0, 1.3]
    assert s["tokens_per_s_pair_ratio_median"] == 1.2


def test_together_needs_a_ferry_peer_and_pairs_of_rounds() -> None:
    assert parse_args(["--peer", "ferry", "--together", "--rounds", "4"]).together
    for bad in (["--peer", "dynamo", "--together", "--rounds", "4"], ["--peer", "ferry", "--together"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
