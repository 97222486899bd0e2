"""`bench.overhead --peer ferry --together`: both Ferrys serve at the same time, each with its own clients.

On this shared 2-core VM the same code's tokens/s moves by ±20 % between rounds run one after another, and
every process's cost per token with it (docs/benchmarks.md, "Side by side with NVIDIA Dynamo"): whatever the
host does to one round, it does to the whole round. Two stacks that run at once meet the same host: each
level starts both (fresh), warms both, then drives both at the same concurrency for the same seconds, and
each stack's processes are timed from /proc as in the alternating rounds. Both stacks saturate the cores, so
the scheduler gives their processes alike shares, and the cheaper stack per token streams more tokens.
Only for `--peer ferry`: Dynamo's processes are fewer and multi-threaded, so equal shares would not be fair.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from bench.overhead.measure import run_streams
from bench.overhead.peer import Round, System, level_result, request_body, rounds, snapshot, start, warm
from bench.stack import FerryStack


async def _level(pair: list[Round], c: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One level with both systems started fresh and measured at once; summaries in `pair` order."""
    systems: list[System] = []
    try:
        for r in pair:
            systems.append(await start(r, args))
        models = await asyncio.gather(*(warm(s, args) for s in systems))
        print(f"{' and '.join(r.label for r in pair)} together c={c} ({args.level_seconds:g} s) ...", file=sys.stderr)
        before = [snapshot(s.pids) for s in systems]
        runs = await asyncio.gather(*(
            run_streams(s.host, s.port, c, args.requests_per_level, args.level_seconds, request_body(m, args))
            for s, m in zip(systems, models, strict=True)
        ))  # fmt: skip
        after = [snapshot(s.pids) for s in systems]
    finally:
        await asyncio.gather(*(s.stop() for s in systems), return_exceptions=True)
    out = []
    for r, (stats, wall), a, b in zip(pair, runs, before, after, strict=True):
        summary = level_result(r.label, c, stats, wall, FerryStack.usage(a, b), args)
        # The client drives both stacks: its CPU and the machine's other processes are not one system's.
        summary["together"] = True
        out.append(summary)
    return out


async def run_together(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`args.rounds // 2` pairs of rounds, each pair's two systems serving at once; rounds in (ours, peer) order."""
    ours, peer = rounds(args)[:2]
    runs: list[dict[str, Any]] = []
    for k in range(args.rounds // 2):
        # Which stack starts first alternates: the first takes the ports and memory first.
        pair = [ours, peer] if k % 2 == 0 else [peer, ours]
        print(f"pair {k + 1} of {args.rounds // 2}: {pair[0].label} and {pair[1].label} at once", file=sys.stderr)
        levels: dict[str, list[dict[str, Any]]] = {ours.label: [], peer.label: []}
        for c in args.concurrency:
            for r, summary in zip(pair, await _level(pair, c, args), strict=True):
                levels[r.label].append(summary)
        runs.append({"round": 2 * k + 1, "system": ours.label, "levels": levels[ours.label]})
        runs.append({"round": 2 * k + 2, "system": peer.label, "levels": levels[peer.label]})
    return runs
