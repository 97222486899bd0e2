"""The host tier's share of `python -m bench.disagg`: what finite and infinite caches allow on a workload, and how
much of the gap between them a host tier closes.

The bounds are computed from the requests alone, as `python -m bench.routing.bounds` computes them (its
`simulate`, and `bench.workload.infinite_cache_bound`): the infinite-cache bound (one cache that has seen every
earlier request), and the cached fraction of N workers with LRU caches of the device blocks (and of the device
plus host blocks) under perfect affinity. The target (issue 21): with the host tier on, the measured cached
fraction closes at least half the gap between the measured fraction with it off and the infinite-cache bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.routing.bounds import simulate
from bench.workload import infinite_cache_bound

GAP_CLOSED_TARGET = 0.5


def bounds(
    prompts: Sequence[Sequence[int]],
    workers: int,
    device_blocks: int,
    host_blocks: Sequence[int],
    block_size: int,
) -> dict[str, float]:
    """Cached fractions the requests allow: `infinite` (the bound), and `lru_<n>` for N workers with LRU caches of
    n blocks each and perfect affinity (n: the device blocks, and the device plus each host tier size)."""
    out = {"infinite": round(infinite_cache_bound(prompts, block_size).fraction, 4)}
    for extra in sorted({0, *host_blocks}):
        cap = device_blocks + extra
        out[f"lru_{cap}"] = round(simulate(prompts, workers, cap, "affinity", block_size)[0], 4)
    return out


def gap_closed(off: float, on: float, bound: float) -> float | None:
    """Share of the gap from `off` to `bound` that `on` closes (None when there is no gap)."""
    gap = bound - off
    return None if gap <= 0 else (on - off) / gap


def host_tier_verdicts(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """For every run with a host tier, the same system and rate without one: cached fractions, TTFT p90s and the
    share of the gap to the infinite-cache bound that the host tier closed."""
    out: list[dict[str, Any]] = []
    for name, on in rows.items():
        if not on.get("host_blocks"):
            continue
        off = next(
            (
                r
                for r in rows.values()
                if r["base"] == on["base"] and r["rate"] == on["rate"] and not r["host_blocks"]
            ),
            None,
        )
        if off is None or off["cached_fraction"] is None or on["cached_fraction"] is None:
            continue
        closed = gap_closed(off["cached_fraction"], on["cached_fraction"], on["bound"])
        out.append(
            {
                "system": name,
                "host_blocks": on["host_blocks"],
                "cached_off": off["cached_fraction"],
                "cached_on": on["cached_fraction"],
                "bound": on["bound"],
                "gap_closed": None if closed is None else round(closed, 3),
                # The same against what each run's routing allowed (infinite caches per worker): the eviction
                # loss alone, which is all a host tier can recover.
                "routed_off": off.get("routed"),
                "routed_on": on.get("routed"),
                "target_met": closed is not None and closed >= GAP_CLOSED_TARGET,
                "ttft_p90_off_ms": off["ttft_p90_ms"],
                "ttft_p90_on_ms": on["ttft_p90_ms"],
            }
        )
    return out


def verdict_table(verdicts: list[dict[str, Any]]) -> str:
    """The host tier verdicts as a Markdown table."""

    def pc(x: float) -> str:
        return f"{x:.1%}"

    def opt(x: float | None) -> str:
        return "-" if x is None else pc(x)

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:,.0f}"

    lines = [
        "| system | cached off | cached on | bound | gap closed | routing allowed off / on | TTFT p90 off / on |",
        "| --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for v in verdicts:
        closed = "-" if v["gap_closed"] is None else pc(v["gap_closed"])
        lines.append(
            f"| {v['system']} | {pc(v['cached_off'])} | {pc(v['cached_on'])} | {pc(v['bound'])} | {closed} | "
            f"{opt(v['routed_off'])} / {opt(v['routed_on'])} | "
            f"{ms(v['ttft_p90_off_ms'])} / {ms(v['ttft_p90_on_ms'])} |"
        )
    return "\n".join(lines)
