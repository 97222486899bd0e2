"""What a quiet fleet costs and how fast it answers: `ferry up` with doorbells against `--no-doorbell`, A/B/A.

With `--peer-tree PATH` the variant `peer` is the default `ferry up` of another checkout (an earlier commit),
so `--order doorbell,peer,doorbell` measures what a change did to an idle fleet in one run.

For each variant a fresh `ferry up --engine sim --workers N` (default 8) idles for `--idle-s` seconds while the
CPU of each of its processes is read from /proc, then answers `--requests` streamed completions one at a time
(a closed loop: the next is sent when the previous one ends, as a single quiet user does), whose TTFT p50/p90
are reported. Run: `.venv/bin/python -m bench.idle [--out bench/results/idle.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import msgspec

from bench.overhead.measure import pct
from bench.overhead.report import git_info, machine_info
from bench.sse_client import Connection, stream_stats
from bench.stack import FerryStack, run_cleanly

VARIANTS = {"doorbell": [], "no-doorbell": ["--no-doorbell"], "peer": []}


async def measure(name: str, args: argparse.Namespace) -> dict[str, object]:
    """One stack of `name`'s variant: its idle CPU per process, then one-at-a-time TTFT."""
    tree = args.peer_tree if name == "peer" else None
    stack = await FerryStack.start(args.workers, args.speedup, VARIANTS[name], tree=tree)
    try:
        await asyncio.sleep(args.settle_s)  # start-up work (registration, first metadata) is not idling
        before = stack.snapshot()
        await asyncio.sleep(args.idle_s)
        idle = FerryStack.usage(before, stack.snapshot())
        conn = Connection(stack.host, stack.port)
        ttfts: list[float] = []
        failed = 0
        for i in range(args.requests):
            body = msgspec.json.encode(
                {"model": "SmolLM2-135M-Instruct", "prompt": f"Request {i}: say something", "max_tokens": 8,
                 "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            )  # fmt: skip
            stats = stream_stats(await conn.post_json("/v1/completions", body))
            if stats.ok:
                ttfts.append(stats.ttft * 1000)
            else:
                failed += 1
                if failed == 1:
                    print(f"{name}: a request failed: {stats.status} {stats.error}", file=sys.stderr)
        conn.close()
    finally:
        await stack.stop()
    stack_cpu = sum(idle.processes.values())
    p50, p90 = pct(ttfts, 50), pct(ttfts, 90)
    print(
        f"{name:12s} idle CPU {stack_cpu:6.1f}% of a core (broker {idle.processes.get('kafka', 0):.1f}, "
        f"frontend {idle.processes.get('frontend', 0):.1f}); TTFT p50 {p50:.1f} ms, p90 {p90:.1f} ms; "
        f"{failed} failed",
        flush=True,
    )
    return {
        "variant": name,
        "idle": idle.to_json(),
        "idle_stack_percent": round(stack_cpu, 1),
        "ttft_ms": {"p50": round(p50, 2), "p90": round(p90, 2)},
        "requests": args.requests,
        "failed": failed,
    }


async def main(argv: list[str] | None = None) -> None:
    """Run the variants in the order given and print and save what each measured."""
    p = argparse.ArgumentParser(prog="python -m bench.idle", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--order", default="doorbell,no-doorbell,doorbell", help="variants in run order (A/B/A)")
    p.add_argument("--workers", type=int, default=8, help="sim workers (default 8)")
    p.add_argument("--speedup", type=float, default=1.0, help="sim speedup (default 1: real time)")
    p.add_argument("--settle-s", type=float, default=5.0, help="seconds after ready before measuring")
    p.add_argument("--idle-s", type=float, default=20.0, help="seconds of idle CPU measured (default 20)")
    p.add_argument("--requests", type=int, default=60, help="one-at-a-time requests per variant (default 60)")
    p.add_argument("--peer-tree", type=Path, default=None, help="the checkout the variant `peer` runs")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    order = [v.strip() for v in args.order.split(",") if v.strip()]
    unknown = [v for v in order if v not in VARIANTS]
    if unknown:
        sys.exit(f"unknown variant(s) {unknown}; known: {sorted(VARIANTS)}")
    if "peer" in order and args.peer_tree is None:
        sys.exit("the variant `peer` needs --peer-tree")
    if args.peer_tree is not None:
        args.peer_tree = args.peer_tree.resolve()
    machine = machine_info()
    results = [await measure(name, args) for name in order]
    if args.out is not None:
        out = {"command": "python -m bench.idle " + " ".join(sys.argv[1:]), "machine": machine,
               "workers": args.workers, "speedup": args.speedup, "runs": results}  # fmt: skip
        if args.peer_tree is not None:
            out["peer"] = {"tree": str(args.peer_tree), **git_info(args.peer_tree)}
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    run_cleanly(main())
