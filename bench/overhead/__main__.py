"""`python -m bench.overhead`: flags and outputs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.overhead import __doc__ as _DOC
from bench.overhead.report import plot, print_table
from bench.overhead.run import run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=(_DOC or "").split("\n\n")[0])
    p.add_argument(
        "--concurrency", default="1,16,64", help="comma-separated concurrency levels (default 1,16,64)"
    )
    p.add_argument(
        "--requests-per-level", type=int, default=3000, help="most requests per level (default 3000)"
    )
    p.add_argument("--level-seconds", type=float, default=20.0, help="most seconds per level (default 20)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens every request generates (default 128)")
    p.add_argument("--workers", type=int, default=1, help="sim workers behind the frontend (default 1)")
    p.add_argument("--speedup", type=float, default=1e6, help="sim speedup; 1e6 makes engine time ~0")
    p.add_argument(
        "--floor-round-trips", type=int, default=200, help="Kafka floor samples per series (default 200)"
    )
    p.add_argument("--floor-fetch-wait-ms", type=int, default=100,
                   help="consumer fetch_max_wait_ms of the floor; match the frontend's and workers' (default 100)")  # fmt: skip
    p.add_argument("--interference-seconds", type=float, default=15.0,
                   help="seconds of each tokenization-interference phase; 0 skips it (default 15)")  # fmt: skip
    p.add_argument("--long-prompt-chars", type=int, default=100_000, help="size of the long prompts")
    p.add_argument("--long-prompt-clients", type=int, default=1, help="clients sending long prompts")
    p.add_argument("--reuse-stack", action="store_true",
                   help="run every phase on one `ferry up` instead of a fresh one per phase")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("bench/results/overhead.json"), help="JSON results file")
    p.add_argument(
        "--plot", type=Path, default=Path("bench/results/overhead.png"), help="PNG plot ('' = none)"
    )
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for py-spy profiles of the frontend and workers during the busiest level "
                        "and the interference phase (perturbs the numbers)")  # fmt: skip
    args = p.parse_args(argv)
    args.concurrency = [int(x) for x in str(args.concurrency).split(",") if x.strip()]
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs positive integers")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its outputs."""
    import uvloop

    args = parse_args(argv)
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    results = uvloop.run(run(args))
    print_table(results)
    if results.get("profiles"):
        print()
        for name, prof in results["profiles"].items():
            print(f"py-spy {name} ({prof['samples']} samples), top self time:")
            for frame, share in prof["self_percent"][:8]:
                print(f"  {share:5.1f}%  {frame}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}", end="")
    if str(args.plot) and str(args.plot) != "." and plot(results, args.plot):
        print(f" and {args.plot}", end="")
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
