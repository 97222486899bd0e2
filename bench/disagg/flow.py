"""How sequences reach decoding, from the client's timestamps: how evenly their first tokens come and how many
decode at once. A disaggregated system's decode workers see the prefill pool's output, not the arrivals: a
queueing prefill pool spaces sequences out, a fast one passes the arrivals' bursts on, and a decode step's
length grows with the sequences in it (docs/benchmarks.md, "Disaggregated serving")."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

from bench.routing.client import RequestResult


def _first_token_at(x: RequestResult) -> float:
    """When the client had the request's first token, in seconds from the start of the run."""
    return x.scheduled + x.lateness + x.ttft


def first_token_cv(results: Sequence[RequestResult]) -> float | None:
    """Coefficient of variation of the spacing between consecutive first tokens (1 for Poisson arrivals, 0 for
    evenly spaced ones); None below three first tokens."""
    firsts = sorted(_first_token_at(x) for x in results if x.ok and not math.isnan(x.ttft))
    gaps = [b - a for a, b in itertools.pairwise(firsts)]
    if len(gaps) < 2 or statistics.fmean(gaps) == 0:
        return None
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


def decoding_at_once(results: Sequence[RequestResult]) -> dict[int, float]:
    """Share of the time during which any sequence decodes (first token to last) that k of them do, by k."""
    edges: list[tuple[float, int]] = []
    for x in results:
        if x.ok and not math.isnan(x.ttft) and x.itls:
            first = _first_token_at(x)
            edges += [(first, 1), (first + sum(x.itls), -1)]
    edges.sort()
    spent: dict[int, float] = {}
    running, last = 0, edges[0][0] if edges else 0.0
    for at, step in edges:
        if running:
            spent[running] = spent.get(running, 0.0) + at - last
        running, last = running + step, at
    total = sum(spent.values())
    return {k: v / total for k, v in sorted(spent.items())} if total else {}


def decode_flow(results: Sequence[RequestResult]) -> dict[str, object]:
    """The summary fields: first-token spacing CV, mean sequences decoding at once, and their distribution."""
    shares = decoding_at_once(results)
    return {
        "first_token_cv": first_token_cv(results),
        "decoding_mean": sum(k * s for k, s in shares.items()) if shares else None,
        "decoding_shares": {str(k): round(s, 4) for k, s in shares.items()},
    }
