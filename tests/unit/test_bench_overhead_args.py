"""bench.overhead writes its plot beside its JSON unless told otherwise."""

from __future__ import annotations

from pathlib import Path

from bench.overhead.__main__ import parse_args


def test_the_plot_goes_beside_the_results_file() -> None:
    assert parse_args([]).plot == Path("bench/results/overhead.png")
    assert parse_args(["--out", "/tmp/trial.json"]).plot == Path("/tmp/trial.png")
    assert parse_args(["--out", "/tmp/trial.json", "--plot", "/tmp/p.png"]).plot == Path("/tmp/p.png")
    assert str(parse_args(["--plot", ""]).plot) == "."  # '' = no plot, as before
